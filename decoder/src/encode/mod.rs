//! Video encoding: decoded frames → H.264 → CMAF-style fragmented MP4 (an init segment, then one
//! `moof` + `mdat` per segment, each starting with a keyframe, emitted as soon as its last frame is
//! encoded).
//!
//! Layers, each in its own file:
//! - [`frame`]: pixels: VAE output ([C, T, H, W] f32 in [-1, 1]) → RGB8 → YUV 4:2:0 (BT.601, limited range).
//! - [`VideoEncoder`]: one trait, two H.264 backends: OpenH264 (vendored, always built, runs anywhere:
//!   the GPU hosts have no FFmpeg) and x264 through FFmpeg (cargo feature `ffmpeg`).
//! - [`h264`]: Annex B → MP4 sample form, SPS/PPS, the codec string.
//! - [`fmp4`]: the box writer (one muxer for both backends).
//! - [`segment`]: the streaming API, [`SegmentWriter`], the [`SegmentPlan`], and [`encode_segment`].
//! - [`pool`]: the encoder threads that encode segments beside the VAE, in order.
//!
//! Colour: every path converts with the BT.601 matrix into limited range and says so twice (the SPS
//! VUI and the MP4 `colr` box: primaries, transfer and matrix SMPTE 170M, `full_range = 0`), so
//! browsers and FFmpeg convert back identically.

mod error;
pub mod fmp4;
pub mod frame;
pub mod h264;
mod openh264_backend;
pub mod pool;
pub mod segment;
#[cfg(feature = "ffmpeg")]
mod x264_backend;

pub use error::EncodeError;
pub use frame::{RgbFrame, Yuv420Frame, rgb_to_yuv420, vae_output_to_rgb, vae_value_to_u8};
pub use h264::{AccessUnit, ParameterSets};
pub use openh264_backend::OpenH264Encoder;
pub use pool::{EncoderPool, Ticket};
pub use segment::{
    MediaSegment, SegmentPlan, SegmentWriter, StreamInfo, encode_segment, encode_single_fragment,
};
#[cfg(feature = "ffmpeg")]
pub use x264_backend::X264Encoder;

/// Highest frame rate accepted (a sanity bound: Wan renders at 16 or 24 fps).
pub const MAX_FPS: u32 = 240;

/// The stream's fixed shape: frame size and rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VideoParams {
    /// Width in pixels: positive and even.
    pub width: u32,
    /// Height in pixels: positive and even.
    pub height: u32,
    /// Frames per second, 1..=[`MAX_FPS`] (integer: the timescale is `fps × 1000`).
    pub fps: u32,
}

impl VideoParams {
    /// Checks the rules, naming the value that breaks one.
    pub fn validate(&self) -> Result<(), EncodeError> {
        frame::check_dimensions(self.width, self.height)?;
        if self.fps == 0 || self.fps > MAX_FPS {
            return Err(EncodeError::FrameRate {
                fps: self.fps,
                rule: "must be in 1..=240",
            });
        }
        Ok(())
    }
}

/// An H.264 encoder producing one access unit per frame, in frame order, without B-frames (decode
/// order = presentation order).
///
/// Contract: `encode` is called with consecutive `frame_index` values from 0; `force_keyframe` makes
/// that frame an IDR; units may come back from a later call (or `flush`) if the backend delays
/// output, but both backends here return each frame's unit from its own `encode` call. The SPS/PPS
/// are known from construction on, so the init segment can be written before the first frame.
pub trait VideoEncoder: Send {
    /// Backend name (`"openh264"`, `"x264"`), for logs and errors.
    fn backend(&self) -> &'static str;

    /// The stream's SPS and PPS (the init segment's `avcC`); constant for the encoder's life.
    fn parameter_sets(&self) -> &ParameterSets;

    /// Encodes one frame of the stream's size; returns the access units that became ready.
    fn encode(
        &mut self,
        frame: &Yuv420Frame,
        frame_index: u64,
        force_keyframe: bool,
    ) -> Result<Vec<AccessUnit>, EncodeError>;

    /// Ends the stream; returns any access units still held.
    fn flush(&mut self) -> Result<Vec<AccessUnit>, EncodeError>;
}

/// Settings of the OpenH264 backend (Constrained Baseline; rate control in quality mode).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenH264Options {
    /// Target bit rate; `None`: 0.2 bits per pixel per frame (832×480 at 16 fps: 1.28 Mbit/s). A target,
    /// not a cap: frames are never skipped, so the quantiser range decides where quality bottoms out.
    pub bitrate_bps: Option<u32>,
    /// Lowest quantiser the rate control may pick (0..=51, lower = better).
    pub qp_min: u8,
    /// Highest quantiser the rate control may pick (qp_min..=51): caps the worst quality.
    pub qp_max: u8,
    /// Encoder effort: 0 low, 1 medium, 2 high.
    pub complexity: u8,
    /// Encoder threads (0: OpenH264 decides; 1 measured as fast as more at 720p).
    pub threads: u16,
}

impl Default for OpenH264Options {
    fn default() -> Self {
        Self {
            bitrate_bps: None,
            qp_min: 10,
            qp_max: 36,
            complexity: 1,
            threads: 1,
        }
    }
}

/// Settings of the x264 backend (always `tune=zerolatency`, no B-frames, IDRs only at segment starts).
#[derive(Debug, Clone, PartialEq)]
pub struct X264Options {
    /// x264 preset (`ultrafast` … `placebo`); default `veryfast`.
    pub preset: String,
    /// Constant rate factor, 0..=51 (lower = better; 23 is x264's default, 18 near-transparent).
    pub crf: f32,
    /// Encoder threads (0: one per core).
    pub threads: usize,
}

impl Default for X264Options {
    fn default() -> Self {
        Self {
            preset: "veryfast".into(),
            crf: 23.0,
            threads: 0,
        }
    }
}

/// Which encoder to use, with its settings.
#[derive(Debug, Clone, PartialEq)]
pub enum EncoderBackend {
    /// OpenH264, vendored: always available.
    OpenH264(OpenH264Options),
    /// x264 through FFmpeg: needs the cargo feature `ffmpeg` and a system FFmpeg with libx264;
    /// otherwise opening it fails with [`EncodeError::BackendUnavailable`].
    X264(X264Options),
}

impl Default for EncoderBackend {
    fn default() -> Self {
        Self::OpenH264(OpenH264Options::default())
    }
}

/// What segment encoding needs from a backend: the stream's parameter sets (for the init
/// segment, before any frame exists) and a fresh encoder per segment whose parameter sets are
/// those. [`EncoderBackend`] is the product's implementation; the trait is the seam through which
/// tests inject an encoder that fails.
pub trait OpenEncoder: Send + Sync {
    /// Backend name (`"openh264"`, `"x264"`), for logs and errors.
    fn name(&self) -> &'static str;

    /// The SPS and PPS every encoder opened for `params` writes (validated here).
    fn parameter_sets(&self, params: VideoParams) -> Result<ParameterSets, EncodeError>;

    /// A fresh encoder for the segment starting at frame `first_frame` of a stream of `params`,
    /// whose parameter sets must be `sets` (those of [`parameter_sets`](Self::parameter_sets) for
    /// the same `params`): in-band SPS/PPS are checked against them on every IDR, and an encoder
    /// announcing others is refused ([`EncodeError::ParameterSetsChanged`] at `first_frame`).
    fn open_segment(
        &self,
        params: VideoParams,
        sets: &ParameterSets,
        first_frame: u64,
    ) -> Result<Box<dyn VideoEncoder>, EncodeError>;
}

impl EncoderBackend {
    /// Opens an encoder for `params` (validated here), with its own parameter sets.
    pub fn open(&self, params: VideoParams) -> Result<Box<dyn VideoEncoder>, EncodeError> {
        params.validate()?;
        match self {
            Self::OpenH264(options) => Ok(Box::new(OpenH264Encoder::new(params, options)?)),
            #[cfg(feature = "ffmpeg")]
            Self::X264(options) => Ok(Box::new(X264Encoder::new(params, options)?)),
            #[cfg(not(feature = "ffmpeg"))]
            Self::X264(_) => Err(EncodeError::BackendUnavailable {
                backend: "x264",
                reason: "this binary was built without the `ffmpeg` cargo feature".into(),
            }),
        }
    }
}

impl OpenEncoder for EncoderBackend {
    fn name(&self) -> &'static str {
        match self {
            Self::OpenH264(_) => "openh264",
            Self::X264(_) => "x264",
        }
    }

    fn parameter_sets(&self, params: VideoParams) -> Result<ParameterSets, EncodeError> {
        params.validate()?;
        match self {
            // OpenH264 writes its SPS/PPS only with a first frame: a probe encodes one.
            Self::OpenH264(options) => OpenH264Encoder::probe_parameter_sets(params, options),
            // x264 has them at open (global header).
            _ => Ok(self.open(params)?.parameter_sets().clone()),
        }
    }

    fn open_segment(
        &self,
        params: VideoParams,
        sets: &ParameterSets,
        first_frame: u64,
    ) -> Result<Box<dyn VideoEncoder>, EncodeError> {
        params.validate()?;
        match self {
            Self::OpenH264(options) => Ok(Box::new(OpenH264Encoder::with_parameter_sets(
                params,
                options,
                sets.clone(),
            )?)),
            _ => {
                let encoder = self.open(params)?;
                if encoder.parameter_sets() != sets {
                    return Err(EncodeError::ParameterSetsChanged {
                        frame_index: first_frame,
                    });
                }
                Ok(encoder)
            }
        }
    }
}

/// Errors unless `frame` has the stream's size.
fn check_frame_size(
    params: &VideoParams,
    frame: &Yuv420Frame,
    frame_index: u64,
) -> Result<(), EncodeError> {
    if (frame.width(), frame.height()) != (params.width, params.height) {
        return Err(EncodeError::FrameSize {
            frame_index,
            width: params.width,
            height: params.height,
            got_width: frame.width(),
            got_height: frame.height(),
        });
    }
    Ok(())
}
