//! The one error type of video encoding: bad input (sizes, rates, layouts), backend failures, and broken
//! encoder promises (a missing keyframe, a lost frame), each variant carrying the offending values.

use thiserror::Error;

/// Everything that can go wrong between frames in and fMP4 bytes out.
#[derive(Debug, Error)]
pub enum EncodeError {
    /// A frame or stream dimension breaks a rule (H.264 4:2:0 needs even sizes; zero is never allowed).
    #[error("{name} = {value} is invalid: {rule}")]
    Dimension {
        /// `"width"` or `"height"`.
        name: &'static str,
        /// The value given.
        value: u32,
        /// The rule it breaks.
        rule: &'static str,
    },
    /// The frame rate breaks a rule.
    #[error("fps = {fps} is invalid: {rule}")]
    FrameRate {
        /// The value given.
        fps: u32,
        /// The rule it breaks.
        rule: &'static str,
    },
    /// A segment plan breaks a rule.
    #[error("segment plan (first {first}, then {rest} frames per segment) is invalid: {rule}")]
    SegmentPlan {
        /// Frames in the first segment.
        first: u32,
        /// Frames in every later segment.
        rest: u32,
        /// The rule it breaks.
        rule: &'static str,
    },
    /// A frame does not have the size the stream was opened with.
    #[error("frame {frame_index} is {got_width}x{got_height}, the stream is {width}x{height}")]
    FrameSize {
        /// Index of the offending frame in the stream.
        frame_index: u64,
        /// Stream width.
        width: u32,
        /// Stream height.
        height: u32,
        /// Frame width.
        got_width: u32,
        /// Frame height.
        got_height: u32,
    },
    /// A pixel buffer's length does not match its declared shape.
    #[error("{what} buffer holds {got} values, its shape {shape} needs {expected}")]
    BufferLength {
        /// Which buffer (`"rgb24"`, `"yuv420 y plane"`, `"vae output [C, T, H, W]"`, …).
        what: &'static str,
        /// The shape as written by the caller.
        shape: String,
        /// Values needed.
        expected: usize,
        /// Values given.
        got: usize,
    },
    /// The VAE output does not have 3 (RGB) channels.
    #[error("vae output has {channels} channels, RGB video needs 3 (layout [C, T, H, W])")]
    Channels {
        /// Channel count given.
        channels: usize,
    },
    /// The backend asked for is not built into this binary or not present on this machine.
    #[error("encoder backend {backend} is unavailable: {reason}")]
    BackendUnavailable {
        /// Backend name.
        backend: &'static str,
        /// Why.
        reason: String,
    },
    /// The encoder library reported an error.
    #[error("encoder backend {backend} failed while {during}: {message}")]
    Backend {
        /// Backend name.
        backend: &'static str,
        /// What we were doing (`"opening"`, `"encoding frame 12"`, …).
        during: String,
        /// The library's message.
        message: String,
    },
    /// An encoder option is out of range.
    #[error("encoder option {name} = {value} is invalid: {rule}")]
    Option {
        /// Option name.
        name: &'static str,
        /// The value given, as text.
        value: String,
        /// The rule it breaks.
        rule: &'static str,
    },
    /// The H.264 bitstream is not what the muxer can carry.
    #[error("malformed H.264 bitstream from {backend}: {reason}")]
    Bitstream {
        /// Backend name.
        backend: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The encoder emitted parameter sets (SPS/PPS) different from those in the init segment.
    #[error(
        "encoder changed its SPS/PPS at frame {frame_index}; the init segment would no longer describe the stream"
    )]
    ParameterSetsChanged {
        /// First frame carrying the new parameter sets.
        frame_index: u64,
    },
    /// A segment would not start with a keyframe although one was forced.
    #[error(
        "frame {frame_index} starts segment {sequence_number} but the encoder did not make it a keyframe"
    )]
    KeyframeMissing {
        /// Frame index.
        frame_index: u64,
        /// Segment sequence number (1-based, as in `mfhd`).
        sequence_number: u32,
    },
    /// The encoder returned access units out of order, or not one per frame.
    #[error("encoder returned frame {got} where frame {expected} was due")]
    FrameOrder {
        /// The frame index due next.
        expected: u64,
        /// The frame index received.
        got: u64,
    },
    /// The encoder did not return an access unit for every frame by the end of the stream.
    #[error("encoder returned {encoded} access units for {pushed} frames")]
    FramesLost {
        /// Frames pushed.
        pushed: u64,
        /// Access units received.
        encoded: u64,
    },
    /// A segment handed to the encoder is not one of its stream's plan.
    #[error(
        "{frames} frames from frame {first_frame} are not a segment of the plan (the segment \
         holding frame {first_frame} starts at frame {start} and holds {planned} frames)"
    )]
    SegmentFrames {
        /// First frame given.
        first_frame: u64,
        /// Frames given.
        frames: usize,
        /// Where the plan's segment starts.
        start: u64,
        /// Its planned length.
        planned: u32,
    },
    /// A segment is too large for 32-bit MP4 box sizes.
    #[error(
        "segment {sequence_number} holds {bytes} bytes of samples, more than a 32-bit mdat can carry"
    )]
    SegmentTooLarge {
        /// Segment sequence number.
        sequence_number: u32,
        /// Sample bytes.
        bytes: u64,
    },
    /// A frame was pushed after `finish`.
    #[error("frame pushed after the stream was finished")]
    Finished,
}
