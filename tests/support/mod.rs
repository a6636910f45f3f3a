//! What several integration tests share: Python venvs under target/ for the outside clients
//! (the `openai` SDK, grpcio), so nothing is installed into the system or the repository, and
//! running their scripts; reading `/metrics` as a scraper does.

// Each test crate uses a part of this module.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

/// A venv under target/ named `name` with `packages` (pinned, so a new release cannot change a
/// verdict silently) installed from PyPI once; its python.
pub fn python_venv(name: &str, packages: &[&str]) -> PathBuf {
    let venv = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let python = venv.join("bin/python");
    let marker = venv.join(packages.join(" "));
    if !marker.exists() {
        let ok = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .unwrap();
        assert!(ok.success(), "python3 -m venv (Debian: python3-venv)");
        let ok = Command::new(&python)
            .args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
            .args(packages)
            .status()
            .unwrap();
        assert!(ok.success(), "pip install {packages:?}");
        std::fs::write(&marker, "").unwrap();
    }
    python
}

/// Runs `python script args…` off the runtime; its JSON report (the last line of stdout), or a
/// failure with everything it printed.
pub async fn run_script(
    python: PathBuf,
    script: &'static str,
    args: Vec<String>,
) -> serde_json::Value {
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg(script)
            .args(args)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim().lines().last().unwrap_or_default()).unwrap()
}

/// `/metrics` of the server at `addr`, as a Prometheus scraper gets it (HTTP/1.1 on a new
/// connection): the whole response.
pub async fn scrape(addr: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: ditstream\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).await.unwrap();
    text
}

/// The value of the sample `name` (with its labels) in a `/metrics` text; 0 when absent.
pub fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Waits up to 5 s for `/metrics` at `addr` to show `want` for the sample `name` (the server
/// counts a closed connection just after the client sees it close).
pub async fn metric_reaches(addr: std::net::SocketAddr, name: &str, want: f64) {
    metric_until(addr, name, &format!("{want}"), |got| got == want).await
}

/// Waits up to 5 s for `/metrics` at `addr` to show more than `floor` for the sample `name`.
pub async fn metric_passes(addr: std::net::SocketAddr, name: &str, floor: f64) {
    metric_until(addr, name, &format!("more than {floor}"), |got| got > floor).await
}

async fn metric_until(
    addr: std::net::SocketAddr,
    name: &str,
    want: &str,
    ok: impl Fn(f64) -> bool,
) {
    let start = std::time::Instant::now();
    loop {
        let text = scrape(addr).await;
        let got = sample(&text, name);
        if ok(got) {
            return;
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(5),
            "{name} = {got}, expected {want}\n{text}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}
