//! The vendored encoder backend: Cisco's OpenH264 (built from source into the binary by the `openh264`
//! crate, so it runs on hosts without FFmpeg). Constrained Baseline profile, one IDR forced at every
//! segment start, no frame skipping, no scene-cut or periodic IDRs. OpenH264's own log (which it
//! would print raw on stderr) goes through `tracing`, target `openh264`.

use openh264::encoder::{
    BitRate, Complexity, Encoder, EncoderConfig, FrameRate, FrameType, IntraFramePeriod, QpRange,
    RateControlMode, SpsPpsStrategy, UsageType, VuiConfig,
};
use openh264::formats::YUVSlices;
use openh264::{OpenH264API, Timestamp};
use tracing::debug;

use super::h264::{AccessUnit, ParameterSets};
use super::{EncodeError, OpenH264Options, VideoEncoder, VideoParams, Yuv420Frame};

const BACKEND: &str = "openh264";

/// [`VideoEncoder`] over OpenH264. Outputs one access unit per input frame, immediately (no delay).
pub struct OpenH264Encoder {
    encoder: Encoder,
    params: VideoParams,
    parameter_sets: ParameterSets,
    started: bool,
}

fn backend_err(during: impl Into<String>, e: openh264::Error) -> EncodeError {
    EncodeError::Backend {
        backend: BACKEND,
        during: during.into(),
        message: e.to_string(),
    }
}

fn encoder_config(
    params: VideoParams,
    options: &OpenH264Options,
) -> Result<EncoderConfig, EncodeError> {
    if options.qp_max > 51 || options.qp_min > options.qp_max {
        return Err(EncodeError::Option {
            name: "qp_min..qp_max",
            value: format!("{}..{}", options.qp_min, options.qp_max),
            rule: "need qp_min <= qp_max <= 51",
        });
    }
    let bitrate = match options.bitrate_bps {
        Some(bps) => bps,
        None => {
            let pixels_per_second =
                u64::from(params.width) * u64::from(params.height) * u64::from(params.fps);
            u32::try_from(pixels_per_second / 5).unwrap_or(u32::MAX) // 0.2 bits per pixel
        }
    };
    let complexity = match options.complexity {
        0 => Complexity::Low,
        1 => Complexity::Medium,
        2 => Complexity::High,
        other => {
            return Err(EncodeError::Option {
                name: "complexity",
                value: other.to_string(),
                rule: "0 (low), 1 (medium) or 2 (high)",
            });
        }
    };
    Ok(EncoderConfig::new()
        .usage_type(UsageType::CameraVideoRealTime)
        .rate_control_mode(RateControlMode::Quality)
        .bitrate(BitRate::from_bps(bitrate))
        .max_frame_rate(FrameRate::from_hz(params.fps as f32))
        .qp(QpRange::new(options.qp_min, options.qp_max))
        .complexity(complexity)
        .skip_frames(false) // every frame must produce a sample: segments count frames
        .scene_change_detect(false) // keyframes exactly at segment starts
        .intra_frame_period(IntraFramePeriod::from_num_frames(0)) // no periodic IDR: we force them
        .sps_pps_strategy(SpsPpsStrategy::ConstantId) // one SPS/PPS for the whole stream (avcC)
        .num_threads(options.threads)
        .vui(VuiConfig::bt601()))
}

/// OpenH264's log lines, into `tracing`. Its warnings are about settings this backend chooses
/// on purpose (no frame skipping under quality rate control), so they are debug events; its
/// errors also fail the call that caused them, so they are warnings here.
unsafe extern "C" fn trace(
    _context: *mut std::ffi::c_void,
    level: std::ffi::c_int,
    line: *const std::ffi::c_char,
) {
    if line.is_null() {
        return;
    }
    // SAFETY: OpenH264 passes a NUL-terminated string valid for the duration of the call.
    let text = unsafe { std::ffi::CStr::from_ptr(line) }.to_string_lossy();
    let text = text.trim_end();
    match level {
        l if l <= openh264_sys2::WELS_LOG_ERROR as std::ffi::c_int => {
            tracing::warn!(target: "openh264", "{text}")
        }
        l if l <= openh264_sys2::WELS_LOG_WARNING as std::ffi::c_int => {
            tracing::debug!(target: "openh264", "{text}")
        }
        _ => tracing::trace!(target: "openh264", "{text}"),
    }
}

/// An encoder whose log goes through [`trace`] from the start: the callback is set before the
/// first frame, which is when OpenH264 initialises and logs its warnings.
fn open_encoder(config: EncoderConfig) -> Result<Encoder, EncodeError> {
    let mut encoder = Encoder::with_api_config(OpenH264API::from_source(), config)
        .map_err(|e| backend_err("opening", e))?;
    let mut callback: openh264_sys2::WelsTraceCallback = Some(trace);
    // SAFETY: the trace options are the ones OpenH264 accepts before initialisation; it copies
    // the function pointer, which is 'static, and passes no context we would read.
    let rc = unsafe {
        encoder.raw_api().set_option(
            openh264_sys2::ENCODER_OPTION_TRACE_CALLBACK,
            (&raw mut callback).cast(),
        )
    };
    if rc != 0 {
        debug!(
            rc,
            "OpenH264 refused its trace callback: its log stays on stderr"
        );
    }
    Ok(encoder)
}

impl OpenH264Encoder {
    /// Opens an encoder for `params` (already validated by the caller: even sizes, fps in range),
    /// with the parameter sets of [`probe_parameter_sets`](Self::probe_parameter_sets).
    pub fn new(params: VideoParams, options: &OpenH264Options) -> Result<Self, EncodeError> {
        let parameter_sets = Self::probe_parameter_sets(params, options)?;
        Self::with_parameter_sets(params, options, parameter_sets)
    }

    /// The SPS/PPS an encoder of this configuration writes. OpenH264 writes them only with the
    /// first frame, but the init segment is wanted before any frame exists: an encoder with the
    /// identical configuration encodes one grey frame and its parameter sets are kept.
    pub fn probe_parameter_sets(
        params: VideoParams,
        options: &OpenH264Options,
    ) -> Result<ParameterSets, EncodeError> {
        let mut probe = open_encoder(encoder_config(params, options)?)?;
        let (w, h) = (params.width as usize, params.height as usize);
        let grey = Yuv420Frame::new(
            params.width,
            params.height,
            vec![128; w * h],
            vec![128; w * h / 4],
            vec![128; w * h / 4],
        )?;
        let stream = probe
            .encode(&slices(&grey))
            .map_err(|e| backend_err("probing parameter sets", e))?
            .to_vec();
        let sets = ParameterSets::from_annex_b(BACKEND, &stream)?;
        debug!(codec = %sets.codec_string(), width = params.width, height = params.height, "openh264 parameter sets probed");
        Ok(sets)
    }

    /// Opens an encoder whose in-band SPS/PPS must be `parameter_sets` (checked on every IDR:
    /// [`EncodeError::ParameterSetsChanged`] if they ever differ).
    pub fn with_parameter_sets(
        params: VideoParams,
        options: &OpenH264Options,
        parameter_sets: ParameterSets,
    ) -> Result<Self, EncodeError> {
        Ok(Self {
            encoder: open_encoder(encoder_config(params, options)?)?,
            params,
            parameter_sets,
            started: false,
        })
    }
}

fn slices(frame: &Yuv420Frame) -> YUVSlices<'_> {
    let (w, h) = (frame.width() as usize, frame.height() as usize);
    YUVSlices::new((frame.y(), frame.u(), frame.v()), (w, h), (w, w / 2, w / 2))
}

impl VideoEncoder for OpenH264Encoder {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn parameter_sets(&self) -> &ParameterSets {
        &self.parameter_sets
    }

    fn encode(
        &mut self,
        frame: &Yuv420Frame,
        frame_index: u64,
        force_keyframe: bool,
    ) -> Result<Vec<AccessUnit>, EncodeError> {
        super::check_frame_size(&self.params, frame, frame_index)?;
        // Before the first frame the encoder is not initialised (and the first frame is an IDR anyway).
        if force_keyframe && self.started {
            self.encoder.force_intra_frame();
        }
        let millis = frame_index * 1000 / u64::from(self.params.fps);
        let bitstream = self
            .encoder
            .encode_at(&slices(frame), Timestamp::from_millis(millis))
            .map_err(|e| backend_err(format!("encoding frame {frame_index}"), e))?;
        self.started = true;
        if bitstream.frame_type() == FrameType::Skip || bitstream.num_layers() == 0 {
            return Err(EncodeError::Bitstream {
                backend: BACKEND,
                reason: format!("frame {frame_index} was skipped"),
            });
        }
        let annex_b = bitstream.to_vec();
        let au = AccessUnit::from_annex_b(BACKEND, frame_index, &annex_b, &self.parameter_sets)?;
        Ok(vec![au])
    }

    fn flush(&mut self) -> Result<Vec<AccessUnit>, EncodeError> {
        Ok(Vec::new()) // OpenH264 never holds frames back
    }
}
