//! The encoder pool against the sequential path: a decoder stage whose segments encode on worker
//! threads writes the same bytes as one whose segments encode on the VAE's thread
//! (`serving.encoder_threads: 0`), for the default plan and for one-frame segments (every other
//! segment's encoder primes itself so that consecutive IDRs differ in `idr_pic_id`), and every
//! file passes ffprobe with one keyframe per segment.
//!
//! The tiny model's VAE with random weights on the CPU; 64×48, 9 and 17 frames.

use std::process::Command;

use anyhow::{Context, Result, ensure};
use ditstream_common::config::Config;
use ditstream_decoder::stage::{DecodeJob, DecodeStage};
use ditstream_kernels::{DType, Device, Tensor};

fn stage(encoder_threads: usize) -> Result<DecodeStage> {
    let yaml = format!(
        "model:\n  preset: tiny\nserving:\n  width: 64\n  height: 48\n  num_frames: 17\n  \
         encoder_threads: {encoder_threads}\n"
    );
    let cfg = Config::parse(&yaml, "<test>")?;
    cfg.validate(Some(1))?;
    Ok(DecodeStage::from_config(&cfg)?)
}

fn job(num_frames: usize, segment_frames: usize) -> DecodeJob {
    DecodeJob {
        width: 64,
        height: 48,
        num_frames,
        fps: 12,
        segment_frames,
    }
}

/// A seeded latent of the job's shape.
fn latent(stage: &DecodeStage, job: &DecodeJob) -> Result<Tensor> {
    let (t, h, w) = stage
        .geometry()
        .latent_grid(job.num_frames, job.height, job.width);
    Ok(Tensor::randn(
        &[1, stage.latent_channels(), t, h, w],
        DType::F32,
        3,
        Device::Cpu,
    )?)
}

/// ffprobe's keyframe flags, one per frame ("K" or "_"), and the `idr_pic_id` of every IDR
/// slice as FFmpeg's `trace_headers` bitstream filter reads it.
fn keyframes(mp4: &[u8], name: &str) -> Result<(String, Vec<u32>)> {
    let dir = std::env::temp_dir().join(format!("ditstream-pool-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(name);
    std::fs::write(&path, mp4)?;
    let trace = Command::new("ffmpeg")
        .args(["-hide_banner", "-i"])
        .arg(&path)
        .args(["-c", "copy", "-bsf:v", "trace_headers", "-f", "null", "-"])
        .output()
        .context("ffmpeg is required (scripts/install-deps.sh installs it)")?;
    ensure!(trace.status.success(), "ffmpeg trace_headers failed");
    let ids = String::from_utf8_lossy(&trace.stderr)
        .lines()
        .filter(|l| l.contains(" idr_pic_id "))
        .map(|l| l.rsplit('=').next().unwrap_or("").trim().parse::<u32>())
        .collect::<Result<Vec<_>, _>>()?;
    let out = Command::new("ffprobe")
        .args([
            "-v",
            "error",
            "-select_streams",
            "v:0",
            "-show_entries",
            "packet=flags",
            "-of",
            "csv=p=0",
        ])
        .arg(&path)
        .output()
        .context("ffprobe is required (scripts/install-deps.sh installs ffmpeg)")?;
    ensure!(
        out.status.success(),
        "ffprobe {}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_file(&path);
    let flags = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| if l.starts_with('K') { 'K' } else { '_' })
        .collect();
    Ok((flags, ids))
}

#[test]
fn the_pool_writes_the_bytes_of_the_sequential_path() -> Result<()> {
    let sequential = stage(0)?;
    let pooled = stage(3)?;
    ensure!(sequential.encoder_threads() == 0 && pooled.encoder_threads() == 3);
    // The last segment is cut in halves (from 4 frames: `SegmentPlan::split_last`).
    for (frames, segment_frames, expected_keys) in [
        (9, 4, "KK___K_K_"),
        (5, 4, "KK_K_"),
        (17, 1, "KKKKKKKKKKKKKKKKK"),
        (17, 3, "KK__K__K__K__K__K"),
    ] {
        let job = job(frames, segment_frames);
        let z = latent(&sequential, &job)?;
        let a = sequential.render_streamed(&job, &z)?;
        let b = pooled.render_streamed(&job, &z)?;
        ensure!(
            a == b,
            "{frames} frames, segments of {segment_frames}: the pool's {} bytes differ from the \
             sequential path's {}",
            b.len(),
            a.len()
        );
        let (keys, ids) = keyframes(&b, &format!("{frames}-{segment_frames}.mp4"))?;
        ensure!(
            keys == expected_keys,
            "{frames} frames, segments of {segment_frames}: keyframes {keys}, expected {expected_keys}"
        );
        // H.264 7.4.3: two consecutive IDR pictures differ in idr_pic_id.
        let idr_frames: Vec<usize> = keys.match_indices('K').map(|(i, _)| i).collect();
        ensure!(
            ids.len() == idr_frames.len(),
            "{} IDR slices for {keys}",
            ids.len()
        );
        for (k, pair) in idr_frames.windows(2).enumerate() {
            ensure!(
                pair[1] != pair[0] + 1 || ids[k] != ids[k + 1],
                "{frames} frames, segments of {segment_frames}: consecutive IDRs at frames {} and \
                 {} share idr_pic_id {} ({ids:?})",
                pair[0],
                pair[1],
                ids[k]
            );
        }
    }
    Ok(())
}
