//! The disaggregated deployment's processes: `ditstream gateway` (the [`crate::gateway`] with
//! its registry), `ditstream denoiser` (`ditstream_denoiser::service`) and `ditstream decoder`
//! (`ditstream_decoder::service`), each its own process (or host), and `ditstream certs`. Each
//! runs until Ctrl-C, then leaves cleanly: the gateway drains, a pool deregisters.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use ditstream_common::config::{Config, socket_addr};
use ditstream_common::link::quic::PoolCa;
use ditstream_decoder::service as decoder;
use ditstream_denoiser::service as denoiser;

/// `ditstream certs`: a fresh pool CA and one certificate for `hosts`, written as `ca.pem`,
/// `pool.pem` and `pool-key.pem` under `out`.
pub fn write_certs(out: &Path, hosts: &[String]) -> anyhow::Result<()> {
    let ca = PoolCa::generate("ditstream pools")?;
    let (cert, key) = ca.issue_pem(hosts)?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    for (name, text) in [
        ("ca.pem", ca.pem()),
        ("pool.pem", cert),
        ("pool-key.pem", key),
    ] {
        let path = out.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Reads and validates a pool config; returns it and the folder its relative paths start from.
fn load(path: &Path) -> anyhow::Result<(Config, std::path::PathBuf)> {
    let cfg = Config::from_file(path)?;
    cfg.validate(None)?;
    let dir = path
        .parent()
        .map_or_else(|| Path::new(".").to_path_buf(), Path::to_path_buf);
    Ok((cfg, dir))
}

async fn until_ctrl_c(what: &str, addr: impl std::fmt::Display) -> anyhow::Result<()> {
    eprintln!("ditstream {what} on {addr} (Ctrl-C stops)");
    tokio::signal::ctrl_c()
        .await
        .context("waiting for Ctrl-C")?;
    tracing::info!("stopping");
    Ok(())
}

/// `ditstream gateway`: serves until Ctrl-C, then drains (`serving.shutdown_grace_s`).
pub async fn run_gateway(path: &Path, listen: Option<SocketAddr>) -> anyhow::Result<()> {
    let (cfg, _) = load(path)?;
    let listen = match listen {
        Some(a) => a,
        None => socket_addr("serving.listen", &cfg.serving.listen)?,
    };
    let gateway = crate::gateway::start(&cfg, listen).await?;
    // Tests and scripts read the real address (port 0 picks one) from this line.
    println!("gateway listening on {}", gateway.addr);
    until_ctrl_c("gateway", gateway.addr).await?;
    gateway
        .stop(Duration::from_secs(cfg.serving.shutdown_grace_s))
        .await;
    Ok(())
}

/// `ditstream denoiser`: serves until Ctrl-C, then deregisters.
pub async fn run_denoiser(path: &Path) -> anyhow::Result<()> {
    let (cfg, dir) = load(path)?;
    let pool = denoiser::start(&cfg, &dir).await?;
    until_ctrl_c("denoiser pool", pool.addr).await?;
    pool.stop().await;
    Ok(())
}

/// `ditstream decoder`: serves until Ctrl-C, then deregisters.
pub async fn run_decoder(path: &Path) -> anyhow::Result<()> {
    let (cfg, dir) = load(path)?;
    let pool = decoder::start(&cfg, &dir).await?;
    until_ctrl_c(
        "decoder instance",
        match pool.link_addr {
            Some(link) => format!("{} (latent link {link})", pool.addr),
            None => pool.addr.to_string(),
        },
    )
    .await?;
    pool.stop().await;
    Ok(())
}
