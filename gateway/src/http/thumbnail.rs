//! `variant=thumbnail`: frame 0 of a video as a PNG. The video's first media segment starts
//! with an IDR frame, so the init segment (for the SPS and PPS in `avcC`) and that one sample
//! are enough: they are decoded with OpenH264 (the crate the encoder already uses) and the
//! picture written with `png`.

/// Why no thumbnail could be made (the file is not what this server writes, or not yet).
#[derive(Debug, thiserror::Error)]
#[error("thumbnail: {0}")]
pub struct ThumbnailError(String);

fn bad(what: impl Into<String>) -> ThumbnailError {
    ThumbnailError(what.into())
}

/// One MP4 box: its type and body.
type Mp4Box<'a> = ([u8; 4], &'a [u8]);

/// The complete boxes of `buf`.
fn boxes(buf: &[u8]) -> Vec<Mp4Box<'_>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i + 8 <= buf.len() {
        let size = u32::from_be_bytes([buf[i], buf[i + 1], buf[i + 2], buf[i + 3]]) as usize;
        if size < 8 || i + size > buf.len() {
            // A box still being written ends the list (the file grows segment by segment).
            break;
        }
        let kind = [buf[i + 4], buf[i + 5], buf[i + 6], buf[i + 7]];
        out.push((kind, &buf[i + 8..i + size]));
        i += size;
    }
    out
}

fn child<'a>(buf: &'a [u8], path: &[&[u8; 4]]) -> Result<&'a [u8], ThumbnailError> {
    let mut cur = buf;
    for name in path {
        cur = boxes(cur)
            .into_iter()
            .find(|(t, _)| t == *name)
            .ok_or_else(|| bad(format!("no {} box", String::from_utf8_lossy(*name))))?
            .1;
    }
    Ok(cur)
}

fn be32(b: &[u8], at: usize) -> Result<u32, ThumbnailError> {
    b.get(at..at + 4)
        .map(|s| u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
        .ok_or_else(|| bad("a box is shorter than its fields"))
}

/// Annex-B parameter sets (SPS, PPS) from an `avcC` record.
fn parameter_sets(avcc: &[u8]) -> Result<Vec<u8>, ThumbnailError> {
    let mut out = Vec::new();
    let mut at = 5;
    for pass in 0..2 {
        let count = usize::from(*avcc.get(at).ok_or_else(|| bad("short avcC"))?)
            & if pass == 0 { 0x1f } else { 0xff };
        at += 1;
        for _ in 0..count {
            let len = usize::from(u16::from_be_bytes([
                *avcc.get(at).ok_or_else(|| bad("short avcC"))?,
                *avcc.get(at + 1).ok_or_else(|| bad("short avcC"))?,
            ]));
            let nal = avcc
                .get(at + 2..at + 2 + len)
                .ok_or_else(|| bad("short avcC"))?;
            out.extend_from_slice(&[0, 0, 0, 1]);
            out.extend_from_slice(nal);
            at += 2 + len;
        }
    }
    Ok(out)
}

/// Frame 0 of a fragmented MP4 this server wrote (init segment, then at least one media
/// segment), as a PNG.
pub fn first_frame_png(mp4: &[u8]) -> Result<Vec<u8>, ThumbnailError> {
    use openh264::formats::YUVSource;
    let top = boxes(mp4);
    let moov = top
        .iter()
        .find(|(t, _)| t == b"moov")
        .ok_or_else(|| bad("no moov box"))?
        .1;
    // The avc1 sample entry's child boxes follow its 78 bytes of fields.
    let stsd = child(moov, &[b"trak", b"mdia", b"minf", b"stbl", b"stsd"])?;
    let entries = boxes(stsd.get(8..).ok_or_else(|| bad("short stsd"))?);
    let avc1 = entries
        .iter()
        .find(|(t, _)| t == b"avc1")
        .ok_or_else(|| bad("no avc1 sample entry"))?
        .1;
    let avcc = child(avc1.get(78..).ok_or_else(|| bad("short avc1"))?, &[b"avcC"])?;
    let mut packet = parameter_sets(avcc)?;
    let moof = top.iter().position(|(t, _)| t == b"moof");
    let (moof, mdat) = match moof {
        Some(i) if top.get(i + 1).is_some_and(|(t, _)| t == b"mdat") => (top[i].1, top[i + 1].1),
        _ => return Err(bad("no media segment yet")),
    };
    // trun (flags 0x701): sample count, data offset, then (duration, size, flags) per sample.
    let trun = child(moof, &[b"traf", b"trun"])?;
    let size = be32(trun, 16)? as usize;
    let mut nals = mdat
        .get(..size)
        .ok_or_else(|| bad("mdat shorter than its sample"))?;
    while nals.len() >= 4 {
        let len = be32(nals, 0)? as usize;
        let nal = nals
            .get(4..4 + len)
            .ok_or_else(|| bad("a NAL unit runs past its sample"))?;
        packet.extend_from_slice(&[0, 0, 0, 1]);
        packet.extend_from_slice(nal);
        nals = &nals[4 + len..];
    }
    let mut decoder =
        openh264::decoder::Decoder::new().map_err(|e| bad(format!("OpenH264: {e}")))?;
    let picture = match decoder
        .decode(&packet)
        .map_err(|e| bad(format!("OpenH264: {e}")))?
    {
        Some(p) => p,
        None => decoder
            .flush_remaining()
            .map_err(|e| bad(format!("OpenH264: {e}")))?
            .into_iter()
            .next()
            .ok_or_else(|| bad("OpenH264 returned no picture"))?,
    };
    let (w, h) = picture.dimensions();
    let mut rgb = vec![0u8; w * h * 3];
    picture.write_rgb8(&mut rgb);
    let mut png_bytes = Vec::new();
    let mut encoder = png::Encoder::new(&mut png_bytes, w as u32, h as u32);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder
        .write_header()
        .map_err(|e| bad(format!("PNG: {e}")))?;
    writer
        .write_image_data(&rgb)
        .map_err(|e| bad(format!("PNG: {e}")))?;
    writer.finish().map_err(|e| bad(format!("PNG: {e}")))?;
    Ok(png_bytes)
}
