//! The disaggregated deployment's processes: `ditstream gateway` (the [`crate::gateway`] with
//! its registry), `ditstream denoiser` (`ditstream_denoiser::service`) and `ditstream decoder`
//! (`ditstream_decoder::service`), each its own process (or host), and the operator's tools:
//! `ditstream certs` (a development pool CA) and `ditstream keys add` (an API key). Each
//! process runs until Ctrl-C, then leaves cleanly: the gateway drains, a pool deregisters.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use ditstream_common::config::{Config, socket_addr};
use ditstream_common::tls::PoolCa;
use ditstream_decoder::service as decoder;
use ditstream_denoiser::service as denoiser;

/// `ditstream certs`: a fresh pool CA and one certificate for `hosts`, written as `ca.pem`,
/// `pool.pem` and `pool-key.pem` under `out`: what every member of a development deployment
/// (gateway, pools) presents on the control plane and the latent link. In production each
/// member gets its own certificate naming its own host.
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

/// `ditstream keys add`: a new API key for `name`, its hash appended to `file`; prints the key.
pub fn add_key(file: &Path, name: &str) -> anyhow::Result<()> {
    let key = crate::gateway::keys::add(file, name)?;
    eprintln!(
        "added API key {name:?} to {} (send SIGHUP to a running gateway to load it); the key, shown once:",
        file.display()
    );
    println!("{key}");
    Ok(())
}

/// Reads and validates a pool config.
fn load(path: &Path) -> anyhow::Result<Config> {
    let cfg = Config::from_file(path)?;
    cfg.validate(None)?;
    Ok(cfg)
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
pub async fn run_gateway(
    path: &Path,
    listen: Option<SocketAddr>,
    registry_listen: Option<SocketAddr>,
) -> anyhow::Result<()> {
    let cfg = load(path)?;
    let listen = match listen {
        Some(a) => a,
        None => socket_addr("serving.listen", &cfg.serving.listen)?,
    };
    let gateway = crate::gateway::start(&cfg, listen, registry_listen).await?;
    // Tests and scripts read the real addresses (port 0 picks one) from these lines.
    println!("gateway listening on {}", gateway.addr);
    if let Some(registry) = gateway.registry_addr {
        println!("pool registry listening on {registry}");
    }
    until_ctrl_c("gateway", gateway.addr).await?;
    gateway
        .stop(Duration::from_secs(cfg.serving.shutdown_grace_s))
        .await;
    Ok(())
}

/// `ditstream denoiser`: serves until Ctrl-C, then deregisters.
pub async fn run_denoiser(path: &Path) -> anyhow::Result<()> {
    let cfg = load(path)?;
    let pool = denoiser::start(&cfg).await?;
    until_ctrl_c("denoiser pool", pool.addr).await?;
    pool.stop().await;
    Ok(())
}

/// `ditstream decoder`: serves until Ctrl-C, then deregisters.
pub async fn run_decoder(path: &Path) -> anyhow::Result<()> {
    let cfg = load(path)?;
    let pool = decoder::start(&cfg).await?;
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
