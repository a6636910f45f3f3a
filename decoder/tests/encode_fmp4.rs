//! End-to-end checks of `encode/`: both H.264 backends through the fMP4 segmenter, checked by FFmpeg's
//! own tools (`ffprobe` for structure, `ffmpeg` for a full decode and for the decoded pixels).
//!
//! The tools come from Debian's `ffmpeg` package (scripts/install-deps.sh). Without them the tests print
//! why and pass, unless `CI` is set: then a missing tool is a failure, so a skip never hides one.
//!
//! Quality thresholds (every frame): decoded YUV against the encoder's input YUV > 40 dB: codec loss
//! alone at the high-quality settings used here (OpenH264 QP <= 20, x264 CRF 16), measured 48.3 and
//! 50.1 dB worst frame. Decoded RGB against the input RGB > 29 dB: colour conversion and signalling
//! included; the 4:2:0 round trip alone reaches only 31.4 dB on this pattern and the codec took 0.2–0.3
//! dB more, while the bugs it must catch score 27 dB or less (derived and checked in
//! `rgb_threshold_separates_right_from_wrong_colour`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use ditstream_decoder::encode::{
    EncodeError, EncoderBackend, MediaSegment, OpenEncoder, OpenH264Options, RgbFrame, SegmentPlan,
    SegmentWriter, VideoParams, X264Options, Yuv420Frame, encode_single_fragment, rgb_to_yuv420,
    vae_output_to_rgb,
};

const WIDTH: u32 = 64;
const HEIGHT: u32 = 48;
const FPS: u32 = 16;
const FRAMES: u32 = 17;
/// Codec loss alone (decoded YUV against the YUV the encoder was given), at the high-quality settings below.
const MIN_YUV_PSNR_DB: f64 = 40.0;
/// End to end in RGB, colour conversion included (derivation in `rgb_threshold_separates_right_from_wrong_colour`).
const MIN_RGB_PSNR_DB: f64 = 29.0;

/// True when ffprobe and ffmpeg run; false (after saying so) when they do not and CI is unset.
fn have_ffmpeg_tools() -> bool {
    let ok = |tool: &str| {
        Command::new(tool)
            .arg("-version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if ok("ffprobe") && ok("ffmpeg") {
        return true;
    }
    if std::env::var_os("CI").is_some() {
        panic!("CI is set but ffprobe/ffmpeg are missing: run scripts/install-deps.sh");
    }
    eprintln!(
        "skipping: ffprobe/ffmpeg not found (install Debian's ffmpeg, or run scripts/install-deps.sh)"
    );
    false
}

/// A smooth gradient background (changing blue over time) with a 12×12 square moving 3 px right and
/// 2 px down per frame (odd steps: its edges cross chroma blocks).
fn pattern(width: u32, height: u32, t: u32) -> RgbFrame {
    let (w, h) = (width as usize, height as usize);
    let mut data = vec![0u8; w * h * 3];
    let (sx, sy) = ((3 * t as usize) % (w - 12), (2 * t as usize) % (h - 12));
    for y in 0..h {
        for x in 0..w {
            let px = &mut data[(y * w + x) * 3..(y * w + x) * 3 + 3];
            if (sx..sx + 12).contains(&x) && (sy..sy + 12).contains(&y) {
                px.copy_from_slice(&[240, 200, 40]);
            } else {
                px.copy_from_slice(&[
                    (x * 255 / (w - 1)) as u8,
                    (y * 255 / (h - 1)) as u8,
                    (64 + 8 * t).min(255) as u8,
                ]);
            }
        }
    }
    RgbFrame::new(width, height, data).expect("w*h*3 bytes")
}

fn frames() -> Vec<RgbFrame> {
    (0..FRAMES).map(|t| pattern(WIDTH, HEIGHT, t)).collect()
}

fn params() -> VideoParams {
    VideoParams {
        width: WIDTH,
        height: HEIGHT,
        fps: FPS,
    }
}

/// Streams `frames` through a SegmentWriter; checks each segment is returned by the push of its last
/// frame; returns init + segments concatenated, and the segments.
fn stream(
    backend: &EncoderBackend,
    frames: &[RgbFrame],
) -> Result<(Vec<u8>, Vec<MediaSegment>, String)> {
    let plan = SegmentPlan::default();
    let mut writer = SegmentWriter::new(backend, params(), plan)?;
    let mut file = writer.init_segment().to_vec();
    let mut segments = Vec::new();
    for (i, frame) in frames.iter().enumerate() {
        let done = writer.push_frame(frame)?;
        let (_, first, len) = plan.segment_of(i as u64);
        let last_of_segment = i as u64 == first + u64::from(len) - 1;
        ensure!(
            done.len() == usize::from(last_of_segment),
            "frame {i}: {} segments returned",
            done.len()
        );
        segments.extend(done);
    }
    segments.extend(writer.finish()?);
    for s in &segments {
        file.extend_from_slice(&s.bytes);
    }
    Ok((file, segments, writer.mime_type()))
}

fn temp_file(name: &str, bytes: &[u8]) -> Result<PathBuf> {
    let path = std::env::temp_dir().join(format!(
        "ditstream-encode-{}-{name}.mp4",
        std::process::id()
    ));
    std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// Runs a tool; returns stdout; fails on a non-zero exit or anything on stderr (all runs use -v error).
fn run(tool: &str, args: &[&str], path: &Path) -> Result<Vec<u8>> {
    let mut cmd = Command::new(tool);
    for a in args {
        if *a == "FILE" {
            cmd.arg(path)
        } else {
            cmd.arg(a)
        };
    }
    let out = cmd.output().with_context(|| format!("running {tool}"))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.success() && stderr.trim().is_empty(),
        "{tool} {args:?}: {}\n{stderr}",
        out.status
    );
    Ok(out.stdout)
}

fn ffprobe(entries: &str, path: &Path) -> Result<serde_json::Value> {
    let out = run(
        "ffprobe",
        &[
            "-v",
            "error",
            "-select_streams",
            "v:0",
            "-count_frames",
            "-show_entries",
            entries,
            "-of",
            "json",
            "FILE",
        ],
        path,
    )?;
    Ok(serde_json::from_slice(&out)?)
}

fn decode_rgb(path: &Path) -> Result<Vec<u8>> {
    run(
        "ffmpeg",
        &[
            "-v", "error", "-i", "FILE", "-f", "rawvideo", "-pix_fmt", "rgb24", "-",
        ],
        path,
    )
}

fn psnr(a: &[u8], b: &[u8]) -> f64 {
    let mse = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
        .sum::<f64>()
        / a.len() as f64;
    if mse == 0.0 {
        f64::INFINITY
    } else {
        10.0 * (255.0f64 * 255.0 / mse).log10()
    }
}

/// Everything the issue asks of one backend's output.
fn check_backend(backend: EncoderBackend, expected_codec_prefix: &str) -> Result<()> {
    let name = backend.name();
    let input = frames();
    let (file, segments, mime) = stream(&backend, &input)?;
    ensure!(
        mime.starts_with(&format!("video/mp4; codecs=\"{expected_codec_prefix}")),
        "{name}: mime {mime}"
    );

    // Segment bookkeeping: 1, 4, 4, 4, 4 frames; sequence numbers 1..; first frames 0, 1, 5, 9, 13.
    let layout: Vec<(u32, u64, u32)> = segments
        .iter()
        .map(|s| (s.sequence_number, s.first_frame, s.frame_count))
        .collect();
    ensure!(
        layout == vec![(1, 0, 1), (2, 1, 4), (3, 5, 4), (4, 9, 4), (5, 13, 4)],
        "{name}: segments {layout:?}"
    );

    let path = temp_file(name, &file)?;
    // Stream-level facts.
    let probe = ffprobe(
        "stream=codec_name,width,height,pix_fmt,r_frame_rate,avg_frame_rate,nb_read_frames,color_space,color_range,color_primaries,color_transfer",
        &path,
    )?;
    let s = &probe["streams"][0];
    let field = |k: &str| {
        s[k].as_str()
            .map(str::to_owned)
            .or_else(|| s[k].as_u64().map(|v| v.to_string()))
            .unwrap_or_default()
    };
    ensure!(field("codec_name") == "h264", "{name}: {s}");
    ensure!(
        (field("width"), field("height")) == (WIDTH.to_string(), HEIGHT.to_string()),
        "{name}: size {s}"
    );
    ensure!(field("pix_fmt") == "yuv420p", "{name}: {s}");
    ensure!(
        field("r_frame_rate") == "16/1" && field("avg_frame_rate") == "16/1",
        "{name}: fps {s}"
    );
    ensure!(
        field("nb_read_frames") == FRAMES.to_string(),
        "{name}: frame count {s}"
    );
    ensure!(
        field("color_space") == "smpte170m" && field("color_range") == "tv",
        "{name}: colour {s}"
    );
    ensure!(
        field("color_primaries") == "smpte170m" && field("color_transfer") == "smpte170m",
        "{name}: colour {s}"
    );

    // Keyframes: the container's sync flags (packets) and the bitstream's picture types (frames).
    let starts = [0usize, 1, 5, 9, 13];
    let packets = ffprobe("packet=pts,flags", &path)?;
    let packets = packets["packets"].as_array().context("no packets")?;
    ensure!(
        packets.len() == FRAMES as usize,
        "{name}: {} packets",
        packets.len()
    );
    for (i, p) in packets.iter().enumerate() {
        let key = p["flags"].as_str().unwrap_or("").starts_with('K');
        ensure!(key == starts.contains(&i), "{name}: packet {i} flags {p}");
    }
    let decoded = ffprobe("frame=key_frame,pict_type", &path)?;
    let decoded = decoded["frames"].as_array().context("no frames")?;
    ensure!(
        decoded.len() == FRAMES as usize,
        "{name}: {} frames",
        decoded.len()
    );
    for &i in &starts {
        ensure!(
            decoded[i]["key_frame"].as_u64() == Some(1) && decoded[i]["pict_type"] == "I",
            "{name}: frame {i} {}",
            decoded[i]
        );
    }

    // A full decode reports nothing.
    run(
        "ffmpeg",
        &["-v", "error", "-i", "FILE", "-f", "null", "-"],
        &path,
    )?;

    // Decoded pixels are close to the input, frame by frame. In YUV (what the encoder saw; no colour
    // conversion on either side) the codec's loss alone is measured; in RGB the colour signalling too.
    let yuv = run(
        "ffmpeg",
        &[
            "-v", "error", "-i", "FILE", "-f", "rawvideo", "-pix_fmt", "yuv420p", "-",
        ],
        &path,
    )?;
    let yuv_bytes = (WIDTH * HEIGHT * 3 / 2) as usize;
    ensure!(
        yuv.len() == yuv_bytes * FRAMES as usize,
        "{name}: decoded {} yuv bytes",
        yuv.len()
    );
    let rgb = decode_rgb(&path)?;
    let frame_bytes = (WIDTH * HEIGHT * 3) as usize;
    ensure!(
        rgb.len() == frame_bytes * FRAMES as usize,
        "{name}: decoded {} rgb bytes",
        rgb.len()
    );
    let (mut worst_yuv, mut worst_rgb, mut worst_shifted) =
        (f64::INFINITY, f64::INFINITY, f64::INFINITY);
    for (t, want) in input.iter().enumerate() {
        let want_yuv = rgb_to_yuv420(want)?;
        let p_yuv = psnr(
            &yuv[t * yuv_bytes..(t + 1) * yuv_bytes],
            &[want_yuv.y(), want_yuv.u(), want_yuv.v()].concat(),
        );
        let got = &rgb[t * frame_bytes..(t + 1) * frame_bytes];
        let p_rgb = psnr(got, want.data());
        ensure!(
            p_yuv > MIN_YUV_PSNR_DB,
            "{name}: frame {t} YUV PSNR {p_yuv:.2} dB <= {MIN_YUV_PSNR_DB}"
        );
        ensure!(
            p_rgb > MIN_RGB_PSNR_DB,
            "{name}: frame {t} RGB PSNR {p_rgb:.2} dB <= {MIN_RGB_PSNR_DB}"
        );
        worst_yuv = worst_yuv.min(p_yuv);
        worst_rgb = worst_rgb.min(p_rgb);
        if let Some(next) = input.get(t + 1) {
            worst_shifted = worst_shifted.min(psnr(got, next.data()));
        }
    }
    // The threshold catches a one-frame shift (a lost or duplicated frame).
    ensure!(
        worst_shifted < MIN_RGB_PSNR_DB,
        "{name}: frames shifted by one still score {worst_shifted:.2} dB"
    );
    eprintln!(
        "{name}: worst frame PSNR {worst_yuv:.2} dB (YUV), {worst_rgb:.2} dB (RGB); {} bytes; {mime}",
        file.len()
    );

    // Streamed segments decode to exactly what one non-streamed encode of the same frames decodes to.
    let whole = encode_single_fragment(&backend, params(), SegmentPlan::default(), &input)?;
    let whole_path = temp_file(&format!("{name}-whole"), &whole)?;
    let whole_rgb = decode_rgb(&whole_path)?;
    ensure!(
        whole_rgb == rgb,
        "{name}: streamed and single-fragment decodes differ"
    );
    // And carry the same samples: the mdat payloads concatenate to the same bytes.
    ensure!(
        mdat_payloads(&file) == mdat_payloads(&whole),
        "{name}: streamed and single-fragment samples differ"
    );

    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&whole_path);
    Ok(())
}

/// Concatenated payloads of the top-level `mdat` boxes.
fn mdat_payloads(file: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut i = 0;
    while i + 8 <= file.len() {
        let size = u32::from_be_bytes(file[i..i + 4].try_into().expect("4 bytes")) as usize;
        if &file[i + 4..i + 8] == b"mdat" {
            out.extend_from_slice(&file[i + 8..i + size]);
        }
        i += size.max(8);
    }
    out
}

fn openh264_high_quality() -> EncoderBackend {
    EncoderBackend::OpenH264(OpenH264Options {
        qp_min: 10,
        qp_max: 20,
        bitrate_bps: Some(4_000_000),
        ..Default::default()
    })
}

#[test]
fn openh264_segments_pass_ffprobe_and_match_the_input() -> Result<()> {
    if !have_ffmpeg_tools() {
        return Ok(());
    }
    // Constrained Baseline: profile_idc 66 (0x42), constraint_set1 (0xc0 with set0).
    check_backend(openh264_high_quality(), "avc1.42")
}

#[cfg(feature = "ffmpeg")]
#[test]
fn x264_segments_pass_ffprobe_and_match_the_input() -> Result<()> {
    if !have_ffmpeg_tools() {
        return Ok(());
    }
    check_backend(
        EncoderBackend::X264(X264Options {
            crf: 16.0,
            ..Default::default()
        }),
        "avc1.64",
    )
}

#[cfg(not(feature = "ffmpeg"))]
#[test]
fn x264_without_the_ffmpeg_feature_says_so() {
    let err = SegmentWriter::new(
        &EncoderBackend::X264(X264Options::default()),
        params(),
        SegmentPlan::default(),
    )
    .err()
    .expect("x264 needs the ffmpeg feature");
    assert!(
        matches!(
            err,
            EncodeError::BackendUnavailable {
                backend: "x264",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("ffmpeg"), "{err}");
}

#[test]
fn odd_sizes_and_bad_rates_are_refused_naming_the_value() {
    let backend = EncoderBackend::default();
    let open = |width, height, fps| {
        SegmentWriter::new(
            &backend,
            VideoParams { width, height, fps },
            SegmentPlan::default(),
        )
    };
    let err = open(63, 48, 16).err().expect("odd width");
    assert!(
        matches!(
            err,
            EncodeError::Dimension {
                name: "width",
                value: 63,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("width = 63") && err.to_string().contains("even"),
        "{err}"
    );
    let err = open(64, 7, 16).err().expect("odd height");
    assert!(err.to_string().contains("height = 7"), "{err}");
    let err = open(64, 48, 0).err().expect("zero fps");
    assert!(err.to_string().contains("fps = 0"), "{err}");

    // A frame of another size than the stream's.
    let mut writer = open(64, 48, 16).expect("valid stream");
    let err = writer
        .push_frame(&pattern(32, 48, 0))
        .expect_err("wrong size");
    assert!(
        err.to_string().contains("32x48") && err.to_string().contains("64x48"),
        "{err}"
    );
    // An odd-sized RGB frame never reaches an encoder.
    assert!(rgb_to_yuv420(&RgbFrame::new(3, 2, vec![0; 18]).expect("18 bytes")).is_err());
}

#[test]
fn vae_chunks_stream_as_segments() -> Result<()> {
    // Latent frame 0 → one video frame, each later latent frame → 4: feed [C, T, H, W] chunks of 1, 4, 4.
    let backend = EncoderBackend::default();
    let mut writer = SegmentWriter::new(&backend, params(), SegmentPlan::default())?;
    let (h, w) = (HEIGHT as usize, WIDTH as usize);
    let mut sent = Vec::new();
    for (chunk, t) in [1usize, 4, 4].into_iter().enumerate() {
        let data: Vec<f32> = (0..3 * t * h * w)
            .map(|i| ((i % 97) as f32 / 48.0) - 1.0 + chunk as f32 * 0.01)
            .collect();
        let frames = vae_output_to_rgb(&data, 3, t, h, w)?;
        let mut got = Vec::new();
        for f in &frames {
            got.extend(writer.push_frame(f)?);
        }
        // The chunk's segment leaves with the chunk's last frame.
        ensure!(
            got.len() == 1 && got[0].frame_count as usize == t,
            "chunk {chunk}: {got:?}"
        );
        sent.extend(got);
    }
    ensure!(
        writer.finish()?.is_empty(),
        "nothing left after whole chunks"
    );
    if sent.iter().map(|s| s.sequence_number).ne(1..=3) {
        bail!(
            "sequence numbers {:?}",
            sent.iter().map(|s| s.sequence_number).collect::<Vec<_>>()
        );
    }
    Ok(())
}

/// BT.601 limited-range YUV → RGB in floats (nearest chroma), the test's independent inverse of
/// `rgb_to_yuv420`; `swap_uv` and `full_range` model the two classic colour bugs.
fn reference_yuv_to_rgb(f: &Yuv420Frame, swap_uv: bool, full_range: bool) -> Vec<u8> {
    let (w, h) = (f.width() as usize, f.height() as usize);
    let mut out = Vec::with_capacity(w * h * 3);
    for y in 0..h {
        for x in 0..w {
            let c = (y / 2) * (w / 2) + x / 2;
            let (mut u, mut v) = (f64::from(f.u()[c]), f64::from(f.v()[c]));
            if swap_uv {
                std::mem::swap(&mut u, &mut v);
            }
            let luma = f64::from(f.y()[y * w + x]);
            let (l, cb, cr) = if full_range {
                (luma / 255.0, (u - 128.0) / 255.0, (v - 128.0) / 255.0)
            } else {
                (
                    (luma - 16.0) / 219.0,
                    (u - 128.0) / 224.0,
                    (v - 128.0) / 224.0,
                )
            };
            let (r, b) = (l + 1.402 * cr, l + 1.772 * cb);
            let g = (l - 0.299 * r - 0.114 * b) / 0.587;
            out.extend([r, g, b].map(|c| (c * 255.0).round().clamp(0.0, 255.0) as u8));
        }
    }
    out
}

/// Where the RGB threshold comes from: with no codec at all, the pattern's RGB → YUV 4:2:0 → RGB round
/// trip is limited by chroma subsampling at the moving square's saturated edges (about 31.4 dB worst
/// frame; both codecs at high quality then measured 31.0–31.2 dB); reading the planes as full range gives
/// about 27.1 dB, swapped U/V about 9 dB, and the one-frame shift checked in `check_backend` about 18.6 dB.
/// 29 dB passes the first with 2 dB to spare and fails the others.
#[test]
fn rgb_threshold_separates_right_from_wrong_colour() -> Result<()> {
    let (mut right, mut full, mut swapped) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
    for frame in frames() {
        let yuv = rgb_to_yuv420(&frame)?;
        right = right.min(psnr(
            &reference_yuv_to_rgb(&yuv, false, false),
            frame.data(),
        ));
        full = full.min(psnr(&reference_yuv_to_rgb(&yuv, false, true), frame.data()));
        swapped = swapped.min(psnr(&reference_yuv_to_rgb(&yuv, true, false), frame.data()));
    }
    eprintln!(
        "4:2:0 round trip {right:.2} dB, full-range misread {full:.2} dB, U/V swapped {swapped:.2} dB"
    );
    ensure!(
        right > MIN_RGB_PSNR_DB + 2.0,
        "round trip {right:.2} dB leaves no room for the codec"
    );
    ensure!(
        full < MIN_RGB_PSNR_DB && swapped < MIN_RGB_PSNR_DB,
        "threshold does not catch colour bugs: {full:.2}, {swapped:.2}"
    );
    Ok(())
}

/// The hand-written boxes, read back by an independent maintained parser (`mp4-atom`): the init
/// segment's sample entry, and in every media segment the sequence number, the track, one trun
/// entry per frame whose sizes fill the mdat exactly, a data offset that points at the mdat's
/// first byte, decode times that continue from segment to segment, and a sync sample first.
#[test]
fn an_independent_parser_reads_every_box() -> Result<()> {
    use mp4_atom::{Codec, Decode, Ftyp, Mdat, Moof, Moov};
    let (file, segments, _) = stream(&openh264_high_quality(), &frames())?;
    let buf = &mut std::io::Cursor::new(file.as_slice());
    Ftyp::decode(buf)?;
    let moov = Moov::decode(buf)?;
    ensure!(moov.mvex.is_some(), "no mvex: not a fragmented MP4");
    ensure!(moov.trak.len() == 1, "{} tracks", moov.trak.len());
    let trak = &moov.trak[0];
    let Some(Codec::Avc1(avc1)) = trak.mdia.minf.stbl.stsd.codecs.first() else {
        bail!(
            "the sample entry is not avc1: {:?}",
            trak.mdia.minf.stbl.stsd.codecs
        );
    };
    ensure!(
        (u32::from(avc1.visual.width), u32::from(avc1.visual.height)) == (WIDTH, HEIGHT),
        "avc1 {}x{}",
        avc1.visual.width,
        avc1.visual.height
    );
    ensure!(
        avc1.avcc.sequence_parameter_sets.len() == 1 && avc1.avcc.picture_parameter_sets.len() == 1,
        "avcC holds {} SPS and {} PPS",
        avc1.avcc.sequence_parameter_sets.len(),
        avc1.avcc.picture_parameter_sets.len()
    );
    let mut decode_time = 0u64;
    for s in &segments {
        let moof_len = u32::from_be_bytes(s.bytes[..4].try_into()?);
        let moof = Moof::decode(buf)?;
        let mdat = Mdat::decode(buf)?;
        ensure!(
            moof.mfhd.sequence_number == s.sequence_number,
            "mfhd {:?}",
            moof.mfhd
        );
        let traf = &moof.traf[0];
        ensure!(
            traf.tfhd.track_id == trak.tkhd.track_id,
            "tfhd {:?}",
            traf.tfhd
        );
        let tfdt = traf.tfdt.as_ref().context("no tfdt")?;
        ensure!(
            tfdt.base_media_decode_time == decode_time,
            "segment {}: decode time {} after {decode_time}",
            s.sequence_number,
            tfdt.base_media_decode_time
        );
        let trun = &traf.trun[0];
        ensure!(
            trun.entries.len() == s.frame_count as usize,
            "{} trun entries",
            trun.entries.len()
        );
        let sizes: usize = trun
            .entries
            .iter()
            .map(|e| e.size.unwrap_or(0) as usize)
            .sum();
        ensure!(
            sizes == mdat.data.len(),
            "samples {sizes} bytes, mdat {}",
            mdat.data.len()
        );
        ensure!(
            trun.data_offset == Some(moof_len as i32 + 8),
            "data offset {:?}, moof {moof_len} bytes",
            trun.data_offset
        );
        // sample_is_non_sync_sample (ISO/IEC 14496-12 §8.8.3.1): clear on the IDR only.
        let non_sync: Vec<bool> = trun
            .entries
            .iter()
            .map(|e| e.flags.unwrap_or(0) & 0x0001_0000 != 0)
            .collect();
        ensure!(
            !non_sync[0] && non_sync[1..].iter().all(|n| *n),
            "sync flags {non_sync:?}"
        );
        decode_time += trun
            .entries
            .iter()
            .map(|e| u64::from(e.duration.unwrap_or(0)))
            .sum::<u64>();
    }
    ensure!(
        buf.position() as usize == file.len(),
        "bytes after the last segment"
    );
    Ok(())
}
