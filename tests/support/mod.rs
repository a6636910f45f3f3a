//! What several integration tests share: Python venvs under target/ for the outside clients
//! (the `openai` SDK, grpcio), so nothing is installed into the system or the repository, and
//! running their scripts.

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
