//! The FFmpeg backend: libx264 through `ffmpeg-next` (cargo feature `ffmpeg`; needs the system's
//! libavcodec, so binaries for the GPU hosts leave it out). `tune=zerolatency` (no lookahead, no frame
//! delay), no B-frames, IDRs only where forced (segment starts), CRF rate control, configurable preset.

use ffmpeg::codec::{self, Flags};
use ffmpeg::format::Pixel;
use ffmpeg::util::color;
use ffmpeg::{Dictionary, Packet, Rational, frame, picture};
use ffmpeg_next as ffmpeg;
use tracing::debug;

use super::h264::{AccessUnit, ParameterSets};
use super::{EncodeError, VideoEncoder, VideoParams, X264Options, Yuv420Frame};

const BACKEND: &str = "x264";

/// [`VideoEncoder`] over libx264 in FFmpeg's libavcodec.
pub struct X264Encoder {
    encoder: ffmpeg::encoder::Video,
    params: VideoParams,
    parameter_sets: ParameterSets,
}

fn backend_err(during: impl Into<String>, e: ffmpeg::Error) -> EncodeError {
    EncodeError::Backend {
        backend: BACKEND,
        during: during.into(),
        message: e.to_string(),
    }
}

impl X264Encoder {
    /// Opens libx264 for `params` (validated by the caller). Errors with
    /// [`EncodeError::BackendUnavailable`] if this FFmpeg has no libx264.
    ///
    /// With `AV_CODEC_FLAG_GLOBAL_HEADER` libx264 writes SPS/PPS into the codec's extradata at open
    /// (and not in-band), so the init segment is available before the first frame.
    pub fn new(params: VideoParams, options: &X264Options) -> Result<Self, EncodeError> {
        if !(0.0..=51.0).contains(&options.crf) {
            return Err(EncodeError::Option {
                name: "crf",
                value: options.crf.to_string(),
                rule: "must be in 0..=51",
            });
        }
        ffmpeg::init().map_err(|e| backend_err("initialising FFmpeg", e))?;
        // libx264 prints a dozen lines per stream at FFmpeg's default level (info) straight to stderr;
        // keep warnings and errors. A level someone chose on purpose (not the default) is left alone.
        if matches!(
            ffmpeg::util::log::get_level(),
            Ok(ffmpeg::util::log::Level::Info)
        ) {
            ffmpeg::util::log::set_level(ffmpeg::util::log::Level::Warning);
        }
        let codec = ffmpeg::encoder::find_by_name("libx264").ok_or_else(|| {
            EncodeError::BackendUnavailable {
                backend: BACKEND,
                reason: "this FFmpeg build has no libx264 encoder".into(),
            }
        })?;
        let mut context = codec::context::Context::new_with_codec(codec);
        context.set_flags(Flags::GLOBAL_HEADER);
        let mut video = context
            .encoder()
            .video()
            .map_err(|e| backend_err("creating the encoder", e))?;
        video.set_width(params.width);
        video.set_height(params.height);
        video.set_format(Pixel::YUV420P);
        let fps = i32::try_from(params.fps).unwrap_or(i32::MAX); // validated ≤ MAX_FPS
        video.set_time_base(Rational(1, fps)); // pts = frame index
        video.set_frame_rate(Some(Rational(fps, 1)));
        video.set_max_b_frames(0);
        // Signal what rgb_to_yuv420 produces: BT.601 (SMPTE 170M), limited range. libx264 copies these
        // into the SPS VUI.
        video.set_colorspace(color::Space::SMPTE170M);
        video.set_color_range(color::Range::MPEG);
        video.set_color_primaries(color::Primaries::SMPTE170M);
        video.set_color_transfer_characteristic(color::TransferCharacteristic::SMPTE170M);

        let mut opts = Dictionary::new();
        opts.set("preset", &options.preset);
        opts.set("tune", "zerolatency");
        opts.set("crf", &options.crf.to_string());
        opts.set("forced-idr", "1"); // a forced keyframe is an IDR, not a recovery-point I frame
        opts.set("threads", &options.threads.to_string());
        // keyint=infinite and scenecut=0: the only IDRs are the ones forced at segment starts.
        opts.set("x264-params", "keyint=infinite:scenecut=0:bframes=0");
        let encoder = video
            .open_with(opts)
            .map_err(|e| backend_err(format!("opening with preset {:?}", options.preset), e))?;

        // SAFETY: `encoder` owns a valid, opened AVCodecContext; after avcodec_open2 with
        // GLOBAL_HEADER, `extradata` is null or points at `extradata_size` bytes owned by the context,
        // which outlives this copy.
        let extradata = unsafe {
            let ctx = encoder.as_ptr();
            let (data, size) = ((*ctx).extradata, (*ctx).extradata_size);
            if data.is_null() || size <= 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(data, size as usize).to_vec()
            }
        };
        let parameter_sets = ParameterSets::from_annex_b(BACKEND, &extradata)?;
        debug!(codec = %parameter_sets.codec_string(), preset = %options.preset, crf = options.crf, "x264 encoder opened");
        Ok(Self {
            encoder,
            params,
            parameter_sets,
        })
    }

    /// Collects every packet the encoder has ready.
    fn drain(&mut self) -> Result<Vec<AccessUnit>, EncodeError> {
        let mut out = Vec::new();
        let mut packet = Packet::empty();
        loop {
            match self.encoder.receive_packet(&mut packet) {
                Ok(()) => {
                    let frame_index = packet
                        .pts()
                        .and_then(|p| u64::try_from(p).ok())
                        .ok_or_else(|| EncodeError::Bitstream {
                            backend: BACKEND,
                            reason: format!("packet without a valid pts ({:?})", packet.pts()),
                        })?;
                    let data = packet.data().unwrap_or_default();
                    let au =
                        AccessUnit::from_annex_b(BACKEND, frame_index, data, &self.parameter_sets)?;
                    if au.keyframe != packet.is_key() {
                        return Err(EncodeError::Bitstream {
                            backend: BACKEND,
                            reason: format!(
                                "frame {frame_index}: packet key flag {} but IDR slice {}",
                                packet.is_key(),
                                au.keyframe
                            ),
                        });
                    }
                    out.push(au);
                }
                Err(ffmpeg::Error::Other { errno }) if errno == ffmpeg::util::error::EAGAIN => {
                    return Ok(out);
                }
                Err(ffmpeg::Error::Eof) => return Ok(out),
                Err(e) => return Err(backend_err("receiving a packet", e)),
            }
        }
    }
}

impl VideoEncoder for X264Encoder {
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
        // A fresh frame each time: the encoder may keep a reference to the last one it was sent.
        let mut av = frame::Video::new(Pixel::YUV420P, self.params.width, self.params.height);
        let (w, h) = (self.params.width as usize, self.params.height as usize);
        for (plane, src, pw, ph) in [
            (0, frame.y(), w, h),
            (1, frame.u(), w / 2, h / 2),
            (2, frame.v(), w / 2, h / 2),
        ] {
            let stride = av.stride(plane);
            let dst = av.data_mut(plane);
            for row in 0..ph {
                dst[row * stride..row * stride + pw]
                    .copy_from_slice(&src[row * pw..(row + 1) * pw]);
            }
        }
        av.set_pts(Some(i64::try_from(frame_index).unwrap_or(i64::MAX)));
        av.set_kind(if force_keyframe {
            picture::Type::I
        } else {
            picture::Type::None
        });
        self.encoder
            .send_frame(&av)
            .map_err(|e| backend_err(format!("sending frame {frame_index}"), e))?;
        self.drain()
    }

    fn flush(&mut self) -> Result<Vec<AccessUnit>, EncodeError> {
        self.encoder
            .send_eof()
            .map_err(|e| backend_err("flushing", e))?;
        self.drain()
    }
}
