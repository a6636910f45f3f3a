//! The streaming API: frames in, an init segment and then media segments out, each media segment
//! returned by the call that supplies its last frame. Also the segment plan (which frames form which
//! segment), [`encode_segment`] (one segment, alone: what the encoder pool runs), and a non-streamed
//! twin that writes the same frames as one fragment, for comparison.
//!
//! Every segment is encoded by an encoder of its own, opened for it: a segment starts with an IDR
//! frame, so nothing in it refers to an earlier one, and with no state carried from segment to
//! segment (rate control included) the bytes of a segment depend only on its frames and its place
//! in the plan. That is what lets segments encode in parallel and still give the same bytes as one
//! after the other.

use tracing::debug;

use super::h264::{AccessUnit, ParameterSets};
use super::{EncodeError, OpenEncoder, RgbFrame, VideoParams, Yuv420Frame, fmp4};

/// How frames are grouped into segments: the first segment holds `first` frames, every later one
/// `rest` frames (the last may be shorter). Every segment starts with a keyframe.
///
/// With [`SegmentPlan::split_last`] the video's length is known and its last segment is cut in two
/// halves, which encode in parallel: the last segment's frames arrive together (one latent frame
/// decodes to all four) and nothing else is left to overlap them with, so its encode is the part
/// of the streaming tail no parallelism hides (≈ 4 × 25 ms at 480p with OpenH264). Halves cost one
/// more IDR frame per video.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentPlan {
    first: u32,
    rest: u32,
    last: Option<LastSegment>,
}

/// The last planned segment, frames `start..end`, cut into parts of `part` frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LastSegment {
    start: u64,
    end: u64,
    part: u64,
}

/// A last segment is cut in two only from this many frames, so both halves have at least two:
/// a run of one-frame segments needs the alternating IDR ids of [`SegmentPlan::follows_lone_idr`],
/// which assumes such runs only where every segment has one frame.
const SPLIT_MIN_FRAMES: u64 = 4;

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
        Ok(Self {
            first,
            rest,
            last: None,
        })
    }

    /// This plan for a video of `frames` frames, with its last segment cut into two halves (the
    /// first half the longer) when it has at least 4 frames.
    pub fn split_last(self, frames: u64) -> Self {
        let uniform = Self { last: None, ..self };
        let Some(last_frame) = frames.checked_sub(1) else {
            return uniform;
        };
        let (_, start, _) = uniform.segment_of(last_frame);
        let len = frames - start;
        if len < SPLIT_MIN_FRAMES {
            return uniform;
        }
        Self {
            last: Some(LastSegment {
                start,
                end: frames,
                part: len.div_ceil(2),
            }),
            ..self
        }
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
        self.segment_of(frame_index).1 == frame_index
    }

    /// The segment holding `frame_index`: (sequence number from 1, first frame, planned frame count).
    pub fn segment_of(&self, frame_index: u64) -> (u32, u64, u32) {
        if let Some(last) = self.last.filter(|l| frame_index >= l.start) {
            let (sequence, _, _) = Self {
                last: None,
                ..*self
            }
            .segment_of(last.start);
            let k = ((frame_index - last.start) / last.part).min(1);
            let start = last.start + k * last.part;
            // Two parts of at most `rest` frames each.
            let planned = (last.end - start).min(last.part) as u32;
            return (sequence + k as u32, start, planned);
        }
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

    /// Whether segment `sequence_number` directly follows a segment of one frame, i.e. its IDR
    /// comes right after another IDR. H.264 wants two consecutive IDR pictures to differ in
    /// `idr_pic_id`, but every fresh encoder numbers its first IDR alike: such a segment's encoder
    /// first encodes a throwaway frame, so that its (second) IDR carries the next id. Only every
    /// other one needs it (ids alternate between two values along a run of one-frame segments).
    pub fn follows_lone_idr(&self, sequence_number: u32) -> bool {
        let previous = match sequence_number {
            0 | 1 => return false,
            2 => self.first,
            _ => self.rest,
        };
        // Not `is_multiple_of`: the workspace's rust-version (1.85) predates it (1.87).
        #[allow(clippy::manual_is_multiple_of)]
        let even = sequence_number % 2 == 0;
        previous == 1 && even
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
        Self {
            first: 1,
            rest: 4,
            last: None,
        }
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

/// Frames → fMP4 segments, streaming, on the calling thread.
///
/// ```text
/// let mut w = SegmentWriter::new(&backend, VideoParams { width, height, fps }, SegmentPlan::default())?;
/// send(w.init_segment());                       // ftyp + moov, available at once
/// for f in frames { for s in w.push_frame(&f)? { send(s) } }   // each segment as soon as complete
/// for s in w.finish()? { send(s) }              // the last, possibly partial, segment
/// ```
/// Concatenating the init segment and all media segments in order gives a playable MP4.
pub struct SegmentWriter<'a> {
    backend: &'a dyn OpenEncoder,
    stream: StreamInfo,
    init: Vec<u8>,
    pushed: u64,
    current: Vec<Yuv420Frame>,
    finished: bool,
}

/// What every segment of one stream shares: its size and rate, its plan and its parameter sets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamInfo {
    /// Frame size and rate.
    pub params: VideoParams,
    /// Which frames form which segment.
    pub plan: SegmentPlan,
    /// The SPS/PPS of the init segment, which every segment's encoder must write.
    pub sets: ParameterSets,
}

impl StreamInfo {
    /// `backend`'s parameter sets for `params` (validated here).
    pub fn new(
        backend: &dyn OpenEncoder,
        params: VideoParams,
        plan: SegmentPlan,
    ) -> Result<Self, EncodeError> {
        Ok(Self {
            params,
            plan,
            sets: backend.parameter_sets(params)?,
        })
    }

    /// The init segment (`ftyp` + `moov`).
    pub fn init_segment(&self) -> Vec<u8> {
        fmp4::init_segment(
            self.params.width,
            self.params.height,
            self.params.fps,
            &self.sets,
        )
    }

    /// MIME type for Media Source Extensions, e.g. `video/mp4; codecs="avc1.42c01e"`.
    pub fn mime_type(&self) -> String {
        format!("video/mp4; codecs=\"{}\"", self.sets.codec_string())
    }
}

impl<'a> SegmentWriter<'a> {
    /// Probes `backend` for `params` (even width and height, fps in 1..=240) and builds the init segment.
    pub fn new(
        backend: &'a dyn OpenEncoder,
        params: VideoParams,
        plan: SegmentPlan,
    ) -> Result<Self, EncodeError> {
        let stream = StreamInfo::new(backend, params, plan)?;
        let init = stream.init_segment();
        Ok(Self {
            backend,
            stream,
            init,
            pushed: 0,
            current: Vec::new(),
            finished: false,
        })
    }

    /// The init segment (`ftyp` + `moov`): send it before any media segment.
    pub fn init_segment(&self) -> &[u8] {
        &self.init
    }

    /// RFC 6381 codec string from the stream's SPS, e.g. `avc1.42c01e`.
    pub fn codec_string(&self) -> String {
        self.stream.sets.codec_string()
    }

    /// MIME type for Media Source Extensions, e.g. `video/mp4; codecs="avc1.42c01e"`.
    pub fn mime_type(&self) -> String {
        self.stream.mime_type()
    }

    /// Stream parameters.
    pub fn params(&self) -> VideoParams {
        self.stream.params
    }

    /// Frames pushed so far.
    pub fn frames_pushed(&self) -> u64 {
        self.pushed
    }

    /// Takes one RGB frame (converted to YUV 4:2:0, BT.601 limited range). Returns the segment this
    /// frame completed, encoded, when it is the last of its segment; none otherwise.
    pub fn push_frame(&mut self, frame: &RgbFrame) -> Result<Vec<MediaSegment>, EncodeError> {
        self.check_frame(frame.width(), frame.height())?;
        let yuv = Yuv420Frame::from_rgb(frame)?;
        self.push_yuv(yuv)
    }

    /// As [`push_frame`](Self::push_frame) for a frame already in YUV 4:2:0 (BT.601, limited range).
    pub fn push_yuv(&mut self, frame: Yuv420Frame) -> Result<Vec<MediaSegment>, EncodeError> {
        if self.finished {
            return Err(EncodeError::Finished);
        }
        self.check_frame(frame.width(), frame.height())?;
        let (_, first, planned) = self.stream.plan.segment_of(self.pushed);
        self.pushed += 1;
        self.current.push(frame);
        if self.current.len() as u64 == u64::from(planned) {
            let frames = std::mem::take(&mut self.current);
            return Ok(vec![encode_segment(
                self.backend,
                &self.stream,
                first,
                &frames,
            )?]);
        }
        Ok(Vec::new())
    }

    /// Ends the stream: returns the last segment if it holds fewer frames than planned. Further
    /// pushes fail.
    pub fn finish(&mut self) -> Result<Vec<MediaSegment>, EncodeError> {
        if self.finished || self.current.is_empty() {
            self.finished = true;
            return Ok(Vec::new());
        }
        self.finished = true;
        let frames = std::mem::take(&mut self.current);
        let first = self.pushed - frames.len() as u64;
        Ok(vec![encode_segment(
            self.backend,
            &self.stream,
            first,
            &frames,
        )?])
    }

    fn check_frame(&self, width: u32, height: u32) -> Result<(), EncodeError> {
        let params = self.stream.params;
        if (width, height) != (params.width, params.height) {
            return Err(EncodeError::FrameSize {
                frame_index: self.pushed,
                width: params.width,
                height: params.height,
                got_width: width,
                got_height: height,
            });
        }
        Ok(())
    }
}

/// Encodes the segment that starts at frame `first_frame` of `stream` (a segment start of its
/// plan) and holds `frames` (its planned length, or fewer for the last segment) into `moof` +
/// `mdat`, with an encoder of its own. Depends on nothing but its arguments: segments encode in
/// any order, on any thread, to the same bytes.
pub fn encode_segment(
    backend: &dyn OpenEncoder,
    stream: &StreamInfo,
    first_frame: u64,
    frames: &[Yuv420Frame],
) -> Result<MediaSegment, EncodeError> {
    let (sequence_number, _, _) = stream.plan.segment_of(first_frame);
    let units = encode_units(backend, stream, first_frame, frames)?;
    let bytes = fmp4::media_segment(sequence_number, first_frame, &units)?;
    debug!(
        sequence_number,
        first_frame,
        frame_count = frames.len(),
        bytes = bytes.len(),
        "media segment complete"
    );
    Ok(MediaSegment {
        sequence_number,
        first_frame,
        frame_count: frames.len() as u32, // ≤ the plan's u32 segment length
        bytes,
    })
}

/// The access units of one segment (see [`encode_segment`]), checked: one per frame, in order, the
/// first a keyframe.
fn encode_units(
    backend: &dyn OpenEncoder,
    stream: &StreamInfo,
    first_frame: u64,
    frames: &[Yuv420Frame],
) -> Result<Vec<AccessUnit>, EncodeError> {
    let (sequence_number, start, planned) = stream.plan.segment_of(first_frame);
    if start != first_frame || frames.is_empty() || frames.len() as u64 > u64::from(planned) {
        return Err(EncodeError::SegmentFrames {
            first_frame,
            frames: frames.len(),
            start,
            planned,
        });
    }
    let mut encoder = backend.open_segment(stream.params, &stream.sets, first_frame)?;
    if stream.plan.follows_lone_idr(sequence_number) {
        // Segment starts at frame ≥ 1 here (sequence number ≥ 2); the throwaway frame takes the
        // index before it, so timestamps still increase.
        encoder.encode(&frames[0], first_frame - 1, false)?;
    }
    let mut units = Vec::with_capacity(frames.len());
    for (i, frame) in frames.iter().enumerate() {
        units.extend(encoder.encode(frame, first_frame + i as u64, i == 0)?);
    }
    units.extend(encoder.flush()?);
    units.retain(|u| u.frame_index >= first_frame);
    if units.len() != frames.len() {
        return Err(EncodeError::FramesLost {
            pushed: frames.len() as u64,
            encoded: units.len() as u64,
        });
    }
    for (i, unit) in units.iter().enumerate() {
        let expected = first_frame + i as u64;
        if unit.frame_index != expected {
            return Err(EncodeError::FrameOrder {
                expected,
                got: unit.frame_index,
            });
        }
    }
    if !units[0].keyframe {
        return Err(EncodeError::KeyframeMissing {
            frame_index: first_frame,
            sequence_number,
        });
    }
    Ok(units)
}

/// Encodes `frames` exactly as [`SegmentWriter`] does (segment by segment, each with its own
/// encoder), but writes them as one MP4 of a single fragment (init segment + one `moof`/`mdat`):
/// the non-streamed reference that streamed output is compared against.
pub fn encode_single_fragment<'f>(
    backend: &dyn OpenEncoder,
    params: VideoParams,
    plan: SegmentPlan,
    frames: impl IntoIterator<Item = &'f RgbFrame>,
) -> Result<Vec<u8>, EncodeError> {
    let stream = StreamInfo::new(backend, params, plan)?;
    let yuv = frames
        .into_iter()
        .map(Yuv420Frame::from_rgb)
        .collect::<Result<Vec<_>, _>>()?;
    let mut units = Vec::with_capacity(yuv.len());
    let mut start = 0usize;
    for len in plan.lengths(yuv.len() as u64) {
        let end = start + len as usize;
        units.extend(encode_units(
            backend,
            &stream,
            start as u64,
            &yuv[start..end],
        )?);
        start = end;
    }
    let mut out = stream.init_segment();
    out.extend(fmp4::media_segment(1, 0, &units)?);
    Ok(out)
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

    /// The last segment is cut in halves of at least two frames; everything before stays.
    #[test]
    fn the_last_segment_splits_in_two() {
        let plan = SegmentPlan::default();
        let split = |frames| plan.split_last(frames).lengths(frames);
        assert_eq!(split(17), vec![1, 4, 4, 4, 2, 2]);
        assert_eq!(split(81), [vec![1], vec![4; 19], vec![2, 2]].concat());
        assert_eq!(split(5), vec![1, 2, 2]);
        // Too short to split: 3 frames would leave a lone frame.
        assert_eq!(split(8), vec![1, 4, 3]);
        assert_eq!(split(1), vec![1]);
        assert_eq!(split(0), Vec::<u32>::new());
        let p = plan.split_last(17);
        assert_eq!(p.segment_of(12), (4, 9, 4));
        assert_eq!(p.segment_of(13), (5, 13, 2));
        assert_eq!(p.segment_of(14), (5, 13, 2));
        assert_eq!(p.segment_of(15), (6, 15, 2));
        assert_eq!(p.segment_of(16), (6, 15, 2));
        let starts: Vec<u64> = (0..17).filter(|&i| p.is_segment_start(i)).collect();
        assert_eq!(starts, vec![0, 1, 5, 9, 13, 15]);
        // Odd lengths: the first half is the longer.
        let p = SegmentPlan::new(1, 5).expect("valid").split_last(11);
        assert_eq!(p.lengths(11), vec![1, 5, 3, 2]);
        // A first segment that is also the last splits too.
        let p = SegmentPlan::new(6, 4).expect("valid").split_last(6);
        assert_eq!(p.lengths(6), vec![3, 3]);
        assert!(!p.follows_lone_idr(2));
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
