//! Encode speed of the segment writer (RGB → YUV → H.264 → fMP4) per backend, default settings:
//! `cargo run --release -p ditstream-decoder --example encode_speed [--features ffmpeg] [WIDTH HEIGHT FRAMES]`.

use std::time::Instant;

use anyhow::Result;
use ditstream_decoder::encode::{
    EncoderBackend, OpenEncoder, OpenH264Options, RgbFrame, SegmentPlan, SegmentWriter,
    VideoParams, X264Options,
};

/// Gradient background with a moving square and some per-frame texture, so motion search has work.
fn pattern(width: u32, height: u32, t: u32) -> Result<RgbFrame> {
    let (w, h, t) = (width as usize, height as usize, t as usize);
    let mut data = Vec::with_capacity(w * h * 3);
    for y in 0..h {
        for x in 0..w {
            let inside = (x + w - (5 * t) % w) % w < w / 5 && (y + h - (3 * t) % h) % h < h / 5;
            let noise = ((x * 7 + y * 13 + t * 31) % 17) as u8;
            if inside {
                data.extend_from_slice(&[230, 190 + noise, 40]);
            } else {
                data.extend_from_slice(&[
                    (x * 255 / w) as u8 ^ noise,
                    (y * 255 / h) as u8,
                    ((x + y + 4 * t) % 256) as u8,
                ]);
            }
        }
    }
    Ok(RgbFrame::new(width, height, data)?)
}

fn main() -> Result<()> {
    let args: Vec<u32> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    let (width, height, count) = match args[..] {
        [w, h, n] => (w, h, n),
        _ => (832, 480, 81),
    };
    let params = VideoParams {
        width,
        height,
        fps: 16,
    };
    let frames: Vec<RgbFrame> = (0..count)
        .map(|t| pattern(width, height, t))
        .collect::<Result<_>>()?;
    let mut backends = vec![EncoderBackend::OpenH264(OpenH264Options::default())];
    if cfg!(feature = "ffmpeg") {
        backends.push(EncoderBackend::X264(X264Options::default()));
    }
    for backend in backends {
        let start = Instant::now();
        let mut writer = SegmentWriter::new(&backend, params, SegmentPlan::default())?;
        let mut bytes = writer.init_segment().len();
        for frame in &frames {
            bytes += writer
                .push_frame(frame)?
                .iter()
                .map(|s| s.bytes.len())
                .sum::<usize>();
        }
        bytes += writer
            .finish()?
            .iter()
            .map(|s| s.bytes.len())
            .sum::<usize>();
        let secs = start.elapsed().as_secs_f64();
        println!(
            "{:>8} {width}x{height} {count} frames: {:.1} fps, {:.0} kbit/s at 16 fps, {}",
            backend.name(),
            f64::from(count) / secs,
            bytes as f64 * 8.0 / (f64::from(count) / 16.0) / 1000.0,
            writer.codec_string()
        );
    }
    Ok(())
}
