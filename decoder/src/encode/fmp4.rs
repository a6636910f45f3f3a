//! The fragmented-MP4 (CMAF-style) muxer, boxes written by hand: the init segment (`ftyp` + `moov` with
//! one H.264 video track and empty sample tables) and media segments (`moof` + `mdat`, one per segment).
//! Both encoder backends go through this one muxer. Layout per ISO/IEC 14496-12 (ISOBMFF) and
//! 14496-15 (`avcC`); field names below are the standard's.

use super::EncodeError;
use super::h264::{AccessUnit, ParameterSets};

/// Media timescale ticks per frame: the timescale is `fps × TICKS_PER_FRAME`, so every integer frame
/// rate has an exact integer frame duration.
pub const TICKS_PER_FRAME: u32 = 1000;

/// The one track's id.
const TRACK_ID: u32 = 1;

/// Sample flags (14496-12 §8.8.3.1) of a sync sample: depends on no other sample (`sample_depends_on = 2`).
pub const SYNC_SAMPLE_FLAGS: u32 = 0x0200_0000;
/// Sample flags of a non-sync sample: depends on others (`sample_depends_on = 1`), `sample_is_non_sync_sample = 1`.
pub const NON_SYNC_SAMPLE_FLAGS: u32 = 0x0101_0000;

/// Largest sample payload of one media segment: the `mdat` and the `trun` data offset are 32-bit.
const MAX_SEGMENT_SAMPLE_BYTES: u64 = (u32::MAX - 8) as u64;

/// Writes one box: `size` (patched at the end), `type`, then what `body` writes.
fn write_box(out: &mut Vec<u8>, kind: &[u8; 4], body: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(kind);
    body(out);
    let size = u32::try_from(out.len() - start)
        // Init boxes are a few hundred bytes; media segments are checked against
        // MAX_SEGMENT_SAMPLE_BYTES before anything is written.
        .expect("box sizes are bounded by the callers");
    out[start..start + 4].copy_from_slice(&size.to_be_bytes());
}

/// Writes one full box: a box whose body starts with `version` (8 bits) and `flags` (24 bits).
fn write_full_box(
    out: &mut Vec<u8>,
    kind: &[u8; 4],
    version: u8,
    flags: u32,
    body: impl FnOnce(&mut Vec<u8>),
) {
    write_box(out, kind, |out| {
        out.extend_from_slice(&((u32::from(version) << 24) | (flags & 0x00ff_ffff)).to_be_bytes());
        body(out);
    });
}

fn u16be(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_be_bytes());
}

fn u32be(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_be_bytes());
}

fn u64be(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_be_bytes());
}

/// The identity transformation matrix of `mvhd` and `tkhd` (16.16 and 2.30 fixed point).
fn unity_matrix(out: &mut Vec<u8>) {
    for v in [0x0001_0000u32, 0, 0, 0, 0x0001_0000, 0, 0, 0, 0x4000_0000] {
        u32be(out, v);
    }
}

/// Init segment: `ftyp` + `moov` for one H.264 track of `width × height` at `fps` frames per second
/// (timescale `fps × TICKS_PER_FRAME`). The sample entry is `avc1` with `avcC` (the SPS/PPS of
/// `params`), `colr` (nclx: BT.601 / SMPTE 170M, limited range, matching the YUV the encoders get)
/// and `pasp` (square pixels). Sample tables are empty and `mvex/trex` announces fragments.
/// Expects parameters checked by [`VideoParams::validate`](super::VideoParams::validate).
pub fn init_segment(width: u32, height: u32, fps: u32, params: &ParameterSets) -> Vec<u8> {
    let timescale = fps.saturating_mul(TICKS_PER_FRAME);
    let mut out = Vec::with_capacity(1024);
    write_box(&mut out, b"ftyp", |o| {
        o.extend_from_slice(b"iso6"); // major brand: fragmented ISOBMFF with tfdt
        u32be(o, 0); // minor version
        for brand in [b"iso6", b"iso5", b"avc1", b"mp41"] {
            o.extend_from_slice(brand);
        }
    });
    write_box(&mut out, b"moov", |o| {
        write_full_box(o, b"mvhd", 0, 0, |o| {
            u32be(o, 0); // creation_time
            u32be(o, 0); // modification_time
            u32be(o, timescale);
            u32be(o, 0); // duration: unknown up front (fragments carry the samples)
            u32be(o, 0x0001_0000); // rate 1.0
            u16be(o, 0x0100); // volume 1.0
            o.extend_from_slice(&[0; 10]); // reserved
            unity_matrix(o);
            o.extend_from_slice(&[0; 24]); // pre_defined
            u32be(o, TRACK_ID + 1); // next_track_ID
        });
        write_box(o, b"trak", |o| {
            write_full_box(o, b"tkhd", 0, 0x3, |o| {
                // flags: track_enabled | track_in_movie
                u32be(o, 0); // creation_time
                u32be(o, 0); // modification_time
                u32be(o, TRACK_ID);
                u32be(o, 0); // reserved
                u32be(o, 0); // duration
                o.extend_from_slice(&[0; 8]); // reserved
                u16be(o, 0); // layer
                u16be(o, 0); // alternate_group
                u16be(o, 0); // volume (video)
                u16be(o, 0); // reserved
                unity_matrix(o);
                u32be(o, width << 16); // 16.16
                u32be(o, height << 16);
            });
            write_box(o, b"mdia", |o| {
                write_full_box(o, b"mdhd", 0, 0, |o| {
                    u32be(o, 0);
                    u32be(o, 0);
                    u32be(o, timescale);
                    u32be(o, 0); // duration
                    u16be(o, 0x55c4); // language "und", packed ISO-639-2/T
                    u16be(o, 0); // pre_defined
                });
                write_full_box(o, b"hdlr", 0, 0, |o| {
                    u32be(o, 0); // pre_defined
                    o.extend_from_slice(b"vide");
                    o.extend_from_slice(&[0; 12]); // reserved
                    o.extend_from_slice(b"ditstream video\0");
                });
                write_box(o, b"minf", |o| {
                    write_full_box(o, b"vmhd", 0, 1, |o| o.extend_from_slice(&[0; 8]));
                    write_box(o, b"dinf", |o| {
                        write_full_box(o, b"dref", 0, 0, |o| {
                            u32be(o, 1); // entry_count
                            write_full_box(o, b"url ", 0, 1, |_| {}); // flags 1: media in this file
                        });
                    });
                    write_box(o, b"stbl", |o| {
                        write_full_box(o, b"stsd", 0, 0, |o| {
                            u32be(o, 1); // entry_count
                            avc1_sample_entry(o, width, height, params);
                        });
                        write_full_box(o, b"stts", 0, 0, |o| u32be(o, 0));
                        write_full_box(o, b"stsc", 0, 0, |o| u32be(o, 0));
                        write_full_box(o, b"stsz", 0, 0, |o| {
                            u32be(o, 0); // sample_size
                            u32be(o, 0); // sample_count
                        });
                        write_full_box(o, b"stco", 0, 0, |o| u32be(o, 0));
                    });
                });
            });
        });
        write_box(o, b"mvex", |o| {
            write_full_box(o, b"trex", 0, 0, |o| {
                u32be(o, TRACK_ID);
                u32be(o, 1); // default_sample_description_index
                u32be(o, TICKS_PER_FRAME); // default_sample_duration
                u32be(o, 0); // default_sample_size
                u32be(o, NON_SYNC_SAMPLE_FLAGS); // default_sample_flags
            });
        });
    });
    out
}

/// `avc1` visual sample entry (14496-12 §12.1.3) with `avcC`, `colr` and `pasp`.
fn avc1_sample_entry(o: &mut Vec<u8>, width: u32, height: u32, params: &ParameterSets) {
    write_box(o, b"avc1", |o| {
        o.extend_from_slice(&[0; 6]); // reserved
        u16be(o, 1); // data_reference_index
        o.extend_from_slice(&[0; 16]); // pre_defined, reserved, pre_defined[3]
        // Sizes are checked ≤ MAX_DIMENSION (8192) before an encoder opens: they fit in 16 bits.
        u16be(o, u16::try_from(width).unwrap_or(u16::MAX));
        u16be(o, u16::try_from(height).unwrap_or(u16::MAX));
        u32be(o, 0x0048_0000); // horizresolution 72 dpi
        u32be(o, 0x0048_0000); // vertresolution
        u32be(o, 0); // reserved
        u16be(o, 1); // frame_count
        let name = b"ditstream h264";
        let mut compressor = [0u8; 32];
        compressor[0] = name.len() as u8;
        compressor[1..=name.len()].copy_from_slice(name);
        o.extend_from_slice(&compressor);
        u16be(o, 0x0018); // depth: colour, no alpha
        u16be(o, 0xffff); // pre_defined = -1
        write_box(o, b"avcC", |o| avc_decoder_configuration(o, params));
        write_box(o, b"colr", |o| {
            o.extend_from_slice(b"nclx");
            u16be(o, 6); // colour_primaries: SMPTE 170M (BT.601 525)
            u16be(o, 6); // transfer_characteristics: SMPTE 170M
            u16be(o, 6); // matrix_coefficients: SMPTE 170M (BT.601)
            o.push(0); // full_range_flag = 0 (limited), 7 bits reserved
        });
        write_box(o, b"pasp", |o| {
            u32be(o, 1); // hSpacing
            u32be(o, 1); // vSpacing
        });
    });
}

/// `AVCDecoderConfigurationRecord` (14496-15 §5.3.3.1): one SPS, one PPS, 4-byte NAL lengths.
fn avc_decoder_configuration(o: &mut Vec<u8>, params: &ParameterSets) {
    o.push(1); // configurationVersion
    o.push(params.profile_idc());
    o.push(params.constraint_flags());
    o.push(params.level_idc());
    o.push(0xfc | 3); // reserved 6 bits, lengthSizeMinusOne = 3
    o.push(0xe0 | 1); // reserved 3 bits, numOfSequenceParameterSets = 1
    // Parameter sets are tens of bytes; a u16 length always holds them.
    u16be(o, u16::try_from(params.sps.len()).unwrap_or(u16::MAX));
    o.extend_from_slice(&params.sps);
    o.push(1); // numOfPictureParameterSets
    u16be(o, u16::try_from(params.pps.len()).unwrap_or(u16::MAX));
    o.extend_from_slice(&params.pps);
    if matches!(params.profile_idc(), 100 | 110 | 122 | 144) {
        // High profiles carry the chroma format and bit depths: 4:2:0, 8 bits, no SPS extensions.
        o.push(0xfc | 1); // chroma_format = 1
        o.push(0xf8); // bit_depth_luma_minus8 = 0
        o.push(0xf8); // bit_depth_chroma_minus8 = 0
        o.push(0); // numOfSequenceParameterSetExt
    }
}

/// One media segment: `moof` (`mfhd` with `sequence_number`; `traf` with `tfhd` (default-base-is-moof),
/// `tfdt` (decode time of the first sample = `first_frame × TICKS_PER_FRAME`) and `trun` (per sample:
/// duration `TICKS_PER_FRAME`, size, and flags: sync for keyframes)) followed by `mdat` with the
/// samples in order. `samples` must be consecutive frames starting at `first_frame`.
pub fn media_segment(
    sequence_number: u32,
    first_frame: u64,
    samples: &[AccessUnit],
) -> Result<Vec<u8>, EncodeError> {
    let bytes: u64 = samples.iter().map(|s| s.data.len() as u64).sum();
    if bytes > MAX_SEGMENT_SAMPLE_BYTES {
        return Err(EncodeError::SegmentTooLarge {
            sequence_number,
            bytes,
        });
    }
    let sample_count = u32::try_from(samples.len()).map_err(|_| EncodeError::SegmentTooLarge {
        sequence_number,
        bytes,
    })?;
    let mut out = Vec::with_capacity(bytes as usize + 128 + 12 * samples.len());
    let mut data_offset_at = 0usize;
    write_box(&mut out, b"moof", |o| {
        write_full_box(o, b"mfhd", 0, 0, |o| u32be(o, sequence_number));
        write_box(o, b"traf", |o| {
            // flags 0x020000: default-base-is-moof (offsets count from this moof's first byte).
            write_full_box(o, b"tfhd", 0, 0x02_0000, |o| u32be(o, TRACK_ID));
            write_full_box(o, b"tfdt", 1, 0, |o| {
                u64be(o, first_frame * u64::from(TICKS_PER_FRAME))
            });
            // flags: data-offset | sample-duration | sample-size | sample-flags present.
            write_full_box(o, b"trun", 0, 0x0001 | 0x0100 | 0x0200 | 0x0400, |o| {
                u32be(o, sample_count);
                data_offset_at = o.len();
                u32be(o, 0); // data_offset, patched below
                for s in samples {
                    u32be(o, TICKS_PER_FRAME);
                    // Each sample is below MAX_SEGMENT_SAMPLE_BYTES (checked above).
                    u32be(o, s.data.len() as u32);
                    u32be(
                        o,
                        if s.keyframe {
                            SYNC_SAMPLE_FLAGS
                        } else {
                            NON_SYNC_SAMPLE_FLAGS
                        },
                    );
                }
            });
        });
    });
    // The first sample starts right after the mdat header, which follows the moof.
    let data_offset = (out.len() + 8) as u32;
    out[data_offset_at..data_offset_at + 4].copy_from_slice(&data_offset.to_be_bytes());
    write_box(&mut out, b"mdat", |o| {
        for s in samples {
            o.extend_from_slice(&s.data);
        }
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A parsed box: type, body range in the buffer.
    fn boxes(buf: &[u8]) -> Vec<([u8; 4], &[u8])> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < buf.len() {
            let size = u32::from_be_bytes(buf[i..i + 4].try_into().expect("4 bytes")) as usize;
            assert!(
                size >= 8 && i + size <= buf.len(),
                "box at {i} of size {size} overruns {}",
                buf.len()
            );
            out.push((
                buf[i + 4..i + 8].try_into().expect("4 bytes"),
                &buf[i + 8..i + size],
            ));
            i += size;
        }
        out
    }

    /// The body of the box at `path` (container boxes only on the way down).
    fn child<'a>(buf: &'a [u8], path: &[&[u8; 4]]) -> &'a [u8] {
        let mut cur = buf;
        for name in path {
            cur = boxes(cur)
                .into_iter()
                .find(|(t, _)| t == *name)
                .unwrap_or_else(|| panic!("no {name:?}"))
                .1;
        }
        cur
    }

    fn params() -> ParameterSets {
        ParameterSets {
            sps: vec![0x67, 0x64, 0x00, 0x1f, 0xac, 0xd9],
            pps: vec![0x68, 0xeb, 0xe3, 0xcb],
        }
    }

    #[test]
    fn init_segment_nests_and_carries_avcc() {
        let init = init_segment(64, 48, 16, &params());
        let top: Vec<_> = boxes(&init).into_iter().map(|(t, _)| t).collect();
        assert_eq!(top, vec![*b"ftyp", *b"moov"]);
        let moov = child(&init, &[b"moov"]);
        let kinds: Vec<_> = boxes(moov).into_iter().map(|(t, _)| t).collect();
        assert_eq!(kinds, vec![*b"mvhd", *b"trak", *b"mvex"]);
        let mdhd = child(&init, &[b"moov", b"trak", b"mdia", b"mdhd"]);
        assert_eq!(
            u32::from_be_bytes(mdhd[12..16].try_into().expect("4")),
            16_000,
            "timescale"
        );
        // stsd: full box header (4) + entry_count (4), then the avc1 entry.
        let stsd = child(
            &init,
            &[b"moov", b"trak", b"mdia", b"minf", b"stbl", b"stsd"],
        );
        let avc1 = boxes(&stsd[8..]);
        assert_eq!(avc1[0].0, *b"avc1");
        let entry = avc1[0].1;
        assert_eq!(u16::from_be_bytes([entry[24], entry[25]]), 64);
        assert_eq!(u16::from_be_bytes([entry[26], entry[27]]), 48);
        let inner: Vec<_> = boxes(&entry[78..]).into_iter().map(|(t, _)| t).collect();
        assert_eq!(inner, vec![*b"avcC", *b"colr", *b"pasp"]);
        let avcc = boxes(&entry[78..])[0].1;
        assert_eq!(&avcc[..6], &[1, 0x64, 0x00, 0x1f, 0xff, 0xe1]);
        assert_eq!(&avcc[6..8], &[0, 6]);
        assert_eq!(&avcc[8..14], params().sps.as_slice());
    }

    #[test]
    fn media_segment_offsets_point_at_the_samples() {
        let samples = vec![
            AccessUnit {
                frame_index: 5,
                keyframe: true,
                data: vec![0, 0, 0, 2, 0x65, 1],
            },
            AccessUnit {
                frame_index: 6,
                keyframe: false,
                data: vec![0, 0, 0, 3, 0x41, 2, 3],
            },
        ];
        let seg = media_segment(2, 5, &samples).expect("small");
        let top = boxes(&seg);
        assert_eq!((top[0].0, top[1].0), (*b"moof", *b"mdat"));
        assert_eq!(top[1].1, &[0, 0, 0, 2, 0x65, 1, 0, 0, 0, 3, 0x41, 2, 3]);
        let mfhd = child(&seg, &[b"moof", b"mfhd"]);
        assert_eq!(u32::from_be_bytes(mfhd[4..8].try_into().expect("4")), 2);
        let tfdt = child(&seg, &[b"moof", b"traf", b"tfdt"]);
        assert_eq!(
            u64::from_be_bytes(tfdt[4..12].try_into().expect("8")),
            5_000
        );
        let trun = child(&seg, &[b"moof", b"traf", b"trun"]);
        let word = |i: usize| u32::from_be_bytes(trun[i..i + 4].try_into().expect("4"));
        assert_eq!(word(4), 2, "sample_count");
        let data_offset = word(8) as usize;
        assert_eq!(
            &seg[data_offset..data_offset + 6],
            samples[0].data.as_slice()
        );
        assert_eq!(
            (word(12), word(16), word(20)),
            (TICKS_PER_FRAME, 6, SYNC_SAMPLE_FLAGS)
        );
        assert_eq!(
            (word(24), word(28), word(32)),
            (TICKS_PER_FRAME, 7, NON_SYNC_SAMPLE_FLAGS)
        );
    }
}
