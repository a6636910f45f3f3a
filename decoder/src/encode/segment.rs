//! The streaming API: frames in, an init segment and then media segments out, each media segment
//! returned by the call that supplies its last frame. Also the segment plan (which frames form which
//! segment) and a non-streamed twin that writes the same frames as one fragment, for comparison.

use tracing::debug;

use super::h264::AccessUnit;
use super::{EncodeError, EncoderBackend, RgbFrame, VideoEncoder, VideoParams, Yuv420Frame, fmp4};

/// How frames are grouped into segments: the first segment holds `first` frames, every later one
/// `rest` frames (the last may be shorter). Every segment starts with a keyframe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentPlan {
    first: u32,
    rest: u32,
}

impl SegmentPlan {
    /// A plan of `first` frames, then `rest` frames per segment. Both must be at least 1.
    pub fn new(first: u32, rest: u32) -> Result<Self, EncodeError> {
        if first == 0 || rest == 0 {
            return Err(EncodeError::SegmentPlan {
                first,
                rest,
                rule: "every segment needs at least one frame",
            });
        }
        Ok(Self { first, rest })
    }

    /// Frames in the first segment.
    pub fn first(&self) -> u32 {
        self.first
    }

    /// Frames in every later segment.
    pub fn rest(&self) -> u32 {
        self.rest
    }

    /// Whether frame `frame_index` opens a segment (and so must be a keyframe).
    pub fn is_segment_start(&self, frame_index: u64) -> bool {
        let (first, rest) = (u64::from(self.first), u64::from(self.rest));
        // Not `is_multiple_of`: the workspace's rust-version (1.85) predates it (1.87).
        #[allow(clippy::manual_is_multiple_of)]
        let on_boundary = frame_index >= first && (frame_index - first) % rest == 0;
        frame_index == 0 || on_boundary
    }

    /// The segment holding `frame_index`: (sequence number from 1, first frame, planned frame count).
    pub fn segment_of(&self, frame_index: u64) -> (u32, u64, u32) {
        let (first, rest) = (u64::from(self.first), u64::from(self.rest));
        if frame_index < first {
            return (1, 0, self.first);
        }
        let k = (frame_index - first) / rest;
        // More than 2^32 segments would need more than 2^32 frames of video.
        (
            u32::try_from(k + 2).unwrap_or(u32::MAX),
            first + k * rest,
            self.rest,
        )
    }

    /// Planned segment lengths for a video of `frames` frames (the last one possibly shorter).
    pub fn lengths(&self, frames: u64) -> Vec<u32> {
        let mut out = Vec::new();
        let mut start = 0u64;
        while start < frames {
            let (_, _, len) = self.segment_of(start);
            let len = u64::from(len).min(frames - start);
            out.push(len as u32); // ≤ a u32 planned length
            start += len;
        }
        out
    }
}

impl Default for SegmentPlan {
    /// The Wan VAE's temporal shape: latent frame 0 decodes to video frame 0 alone, every later latent
    /// frame to 4 video frames. Frame 0 goes out alone so the first playable segment leaves as soon as
    /// the first latent frame is decoded (lowest time to first frame); every later segment is the 4
    /// frames of one latent frame, so it leaves the moment that latent frame is decoded. The price is
    /// one extra IDR (frame 0 alone, then frame 1) compared with grouping frames 0–4.
    fn default() -> Self {
        Self { first: 1, rest: 4 }
    }
}

/// One media segment (`moof` + `mdat`), ready to send or append to the init segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaSegment {
    /// 1-based, consecutive; equals the `mfhd` sequence number.
    pub sequence_number: u32,
    /// Index of the segment's first frame in the video.
    pub first_frame: u64,
    /// Frames in the segment.
    pub frame_count: u32,
    /// The `moof` + `mdat` bytes.
    pub bytes: Vec<u8>,
}

/// Frames → fMP4 segments, streaming.
///
/// ```text
/// let mut w = SegmentWriter::new(&backend, VideoParams { width, height, fps }, SegmentPlan::default())?;
/// send(w.init_segment());                       // ftyp + moov, available at once
/// for f in frames { for s in w.push_frame(&f)? { send(s) } }   // each segment as soon as complete
/// for s in w.finish()? { send(s) }              // the last, possibly partial, segment
/// ```
/// Concatenating the init segment and all media segments in order gives a playable MP4.
pub struct SegmentWriter {
    encoder: Box<dyn VideoEncoder>,
    params: VideoParams,
    plan: SegmentPlan,
    init: Vec<u8>,
    pushed: u64,
    assembler: Assembler,
    finished: bool,
}

impl SegmentWriter {
    /// Opens `backend` for `params` (even width and height, fps in 1..=240) and builds the init segment.
    pub fn new(
        backend: &EncoderBackend,
        params: VideoParams,
        plan: SegmentPlan,
    ) -> Result<Self, EncodeError> {
        let encoder = backend.open(params)?;
        let init = fmp4::init_segment(
            params.width,
            params.height,
            params.fps,
            encoder.parameter_sets(),
        );
        Ok(Self {
            encoder,
            params,
            plan,
            init,
            pushed: 0,
            assembler: Assembler::new(plan),
            finished: false,
        })
    }

    /// The init segment (`ftyp` + `moov`): send it before any media segment.
    pub fn init_segment(&self) -> &[u8] {
        &self.init
    }

    /// RFC 6381 codec string from the stream's SPS, e.g. `avc1.42c01e`.
    pub fn codec_string(&self) -> String {
        self.encoder.parameter_sets().codec_string()
    }

    /// MIME type for Media Source Extensions, e.g. `video/mp4; codecs="avc1.42c01e"`.
    pub fn mime_type(&self) -> String {
        format!("video/mp4; codecs=\"{}\"", self.codec_string())
    }

    /// Stream parameters.
    pub fn params(&self) -> VideoParams {
        self.params
    }

    /// Frames pushed so far.
    pub fn frames_pushed(&self) -> u64 {
        self.pushed
    }

    /// Encodes one RGB frame (converted to YUV 4:2:0, BT.601 limited range). Returns the segments this
    /// frame completed: with both backends (no encoder delay) exactly one when the frame is the last of
    /// its segment, none otherwise.
    pub fn push_frame(&mut self, frame: &RgbFrame) -> Result<Vec<MediaSegment>, EncodeError> {
        self.check_frame(frame.width(), frame.height())?;
        let yuv = Yuv420Frame::from_rgb(frame)?;
        self.push_yuv(&yuv)
    }

    /// As [`push_frame`](Self::push_frame) for a frame already in YUV 4:2:0 (BT.601, limited range).
    pub fn push_yuv(&mut self, frame: &Yuv420Frame) -> Result<Vec<MediaSegment>, EncodeError> {
        if self.finished {
            return Err(EncodeError::Finished);
        }
        self.check_frame(frame.width(), frame.height())?;
        let index = self.pushed;
        let units = self
            .encoder
            .encode(frame, index, self.plan.is_segment_start(index))?;
        self.pushed += 1;
        self.assembler.take(units)
    }

    /// Ends the stream: flushes the encoder and returns the remaining segments (the last one holds
    /// fewer frames than planned when the frame count does not fill it). Further pushes fail.
    pub fn finish(&mut self) -> Result<Vec<MediaSegment>, EncodeError> {
        if self.finished {
            return Ok(Vec::new());
        }
        self.finished = true;
        let units = self.encoder.flush()?;
        let mut out = self.assembler.take(units)?;
        out.extend(self.assembler.close(self.pushed)?);
        Ok(out)
    }

    fn check_frame(&self, width: u32, height: u32) -> Result<(), EncodeError> {
        if (width, height) != (self.params.width, self.params.height) {
            return Err(EncodeError::FrameSize {
                frame_index: self.pushed,
                width: self.params.width,
                height: self.params.height,
                got_width: width,
                got_height: height,
            });
        }
        Ok(())
    }
}

/// Encodes `frames` with the same encoder settings and keyframe plan as [`SegmentWriter`], but writes
/// them as one MP4 of a single fragment (init segment + one `moof`/`mdat`): the non-streamed reference
/// that streamed output is compared against.
pub fn encode_single_fragment<'a>(
    backend: &EncoderBackend,
    params: VideoParams,
    plan: SegmentPlan,
    frames: impl IntoIterator<Item = &'a RgbFrame>,
) -> Result<Vec<u8>, EncodeError> {
    let mut encoder = backend.open(params)?;
    let mut units = Vec::new();
    let mut pushed = 0u64;
    for frame in frames {
        let yuv = Yuv420Frame::from_rgb(frame)?;
        units.extend(encoder.encode(&yuv, pushed, plan.is_segment_start(pushed))?);
        pushed += 1;
    }
    units.extend(encoder.flush()?);
    if units.len() as u64 != pushed {
        return Err(EncodeError::FramesLost {
            pushed,
            encoded: units.len() as u64,
        });
    }
    for (expected, unit) in units.iter().enumerate() {
        let expected = expected as u64;
        if unit.frame_index != expected {
            return Err(EncodeError::FrameOrder {
                expected,
                got: unit.frame_index,
            });
        }
        if plan.is_segment_start(expected) && !unit.keyframe {
            return Err(EncodeError::KeyframeMissing {
                frame_index: expected,
                sequence_number: plan.segment_of(expected).0,
            });
        }
    }
    let mut out = fmp4::init_segment(
        params.width,
        params.height,
        params.fps,
        encoder.parameter_sets(),
    );
    out.extend(fmp4::media_segment(1, 0, &units)?);
    Ok(out)
}

/// Gathers access units (in frame order) into segments per the plan, checking the encoder's promises:
/// one unit per frame, in order, a keyframe at every segment start.
struct Assembler {
    plan: SegmentPlan,
    next_frame: u64,
    pending: Vec<AccessUnit>,
}

impl Assembler {
    fn new(plan: SegmentPlan) -> Self {
        Self {
            plan,
            next_frame: 0,
            pending: Vec::new(),
        }
    }

    fn take(&mut self, units: Vec<AccessUnit>) -> Result<Vec<MediaSegment>, EncodeError> {
        let mut done = Vec::new();
        for unit in units {
            if unit.frame_index != self.next_frame {
                return Err(EncodeError::FrameOrder {
                    expected: self.next_frame,
                    got: unit.frame_index,
                });
            }
            let (sequence_number, first_frame, planned) = self.plan.segment_of(unit.frame_index);
            if unit.frame_index == first_frame && !unit.keyframe {
                return Err(EncodeError::KeyframeMissing {
                    frame_index: unit.frame_index,
                    sequence_number,
                });
            }
            self.next_frame += 1;
            self.pending.push(unit);
            if self.pending.len() as u64 == u64::from(planned) {
                done.push(self.emit()?);
            }
        }
        Ok(done)
    }

    /// Emits the last, partial segment if any; errors if the encoder lost frames.
    fn close(&mut self, pushed: u64) -> Result<Option<MediaSegment>, EncodeError> {
        if self.next_frame != pushed {
            return Err(EncodeError::FramesLost {
                pushed,
                encoded: self.next_frame,
            });
        }
        if self.pending.is_empty() {
            Ok(None)
        } else {
            self.emit().map(Some)
        }
    }

    fn emit(&mut self) -> Result<MediaSegment, EncodeError> {
        let units = std::mem::take(&mut self.pending);
        let first_frame = units.first().map_or(self.next_frame, |u| u.frame_index);
        let (sequence_number, _, _) = self.plan.segment_of(first_frame);
        let bytes = fmp4::media_segment(sequence_number, first_frame, &units)?;
        let frame_count = units.len() as u32; // ≤ the plan's u32 segment length
        debug!(
            sequence_number,
            first_frame,
            frame_count,
            bytes = bytes.len(),
            "media segment complete"
        );
        Ok(MediaSegment {
            sequence_number,
            first_frame,
            frame_count,
            bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_plan_is_one_then_fours() {
        let plan = SegmentPlan::default();
        assert_eq!(plan.lengths(17), vec![1, 4, 4, 4, 4]);
        assert_eq!(plan.lengths(81), [vec![1], vec![4; 20]].concat());
        assert_eq!(plan.lengths(7), vec![1, 4, 2]);
        let starts: Vec<u64> = (0..17).filter(|&i| plan.is_segment_start(i)).collect();
        assert_eq!(starts, vec![0, 1, 5, 9, 13]);
        assert_eq!(plan.segment_of(0), (1, 0, 1));
        assert_eq!(plan.segment_of(4), (2, 1, 4));
        assert_eq!(plan.segment_of(5), (3, 5, 4));
    }

    #[test]
    fn other_plans() {
        let plan = SegmentPlan::new(5, 3).expect("valid");
        assert_eq!(plan.lengths(12), vec![5, 3, 3, 1]);
        assert!(SegmentPlan::new(0, 4).is_err());
        let err = SegmentPlan::new(1, 0).expect_err("zero rest");
        assert!(err.to_string().contains("at least one frame"), "{err}");
    }
}
