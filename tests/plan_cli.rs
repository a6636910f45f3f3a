//! `ditstream plan` as an operator runs it: every shipped config validates and prints its layout;
//! every kind of bad config fails with one line naming the key, and a non-zero exit.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test

use std::path::Path;
use std::process::{Command, Output};

fn plan(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ditstream"))
        .arg("plan")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run ditstream")
}

/// Writes `yaml` to a temp file and runs `plan` on it; returns (success, stdout, stderr).
fn plan_yaml(name: &str, yaml: &str, extra: &[&str]) -> (bool, String, String) {
    let dir = std::env::temp_dir().join(format!("ditstream-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, yaml).unwrap();
    let mut args = vec!["--config", path.to_str().unwrap()];
    args.extend_from_slice(extra);
    let out = plan(&args);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn every_shipped_config_plans() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let out = plan(&["--config", path.to_str().unwrap()]);
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(stdout.contains("denoiser   cfg"), "{stdout}");
            n += 1;
        }
    }
    assert!(
        n >= 8,
        "expected the cpu-tiny, h200 and nvl72 configs, found {n}"
    );
}

#[test]
fn nvl72_plan_shows_the_hand_checked_groups() {
    let out = plan(&["--config", "configs/nvl72-cfg2-ul4-attn2d3x3.yaml"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        stdout.contains("cfg 2 x tp 1 x cp attn2d 3x3 x ulysses 4 = 72 ranks"),
        "{stdout}"
    );
    assert!(
        stdout.contains("ulysses     [0, 1, 2, 3] [4, 5, 6, 7]"),
        "{stdout}"
    );
    assert!(
        stdout.contains("attn2d-row  [0, 4, 8] [1, 5, 9]"),
        "{stdout}"
    );
    assert!(
        stdout.contains("attn2d-col  [0, 12, 24] [1, 13, 25]"),
        "{stdout}"
    );
    assert!(stdout.contains("cfg         [0, 36] [1, 37]"), "{stdout}");
    // Rank 43 = cfg 1, row 0, col 1, uly 3, owning shard 7 of 36 (2,100 tokens each).
    assert!(
        stdout.contains("  43    1   0    0    1    3         7  [14700, 16800)"),
        "{stdout}"
    );
}

#[test]
fn odd_token_counts_are_padded_not_refused() {
    // 480p 81 frames is 32,760 tokens; 16 sequence ranks do not divide it: each shard holds
    // ceil(32760 / 16) = 2048 tokens and the last one carries the 8 padding tokens.
    let (ok, stdout, stderr) = plan_yaml(
        "pad",
        "model:\n  preset: wan2.1-t2v-14b\nparallel_config:\n  ring_size: 4\n  ulysses_size: 4\n",
        &["--video", "832x480x81"],
    );
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("32760 tokens; 16 sequence shards of 2048 (+8 padding)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("  15    0   0    3    0    3        15  [30720, 32760) +8 pad"),
        "{stdout}"
    );
}

#[test]
fn bad_configs_fail_with_one_line_naming_the_key() {
    let cases: &[(&str, &str, &[&str], &str)] = &[
        (
            "unknown",
            "model:\n  preset: tiny\nparallel_config:\n  cfg_sise: 2\n",
            &[],
            "unknown field `cfg_sise`",
        ),
        (
            "product",
            "model:\n  preset: wan2.1-t2v-14b\nparallel_config:\n  cfg_size: 2\n  ulysses_size: 2\n",
            &["--world", "2"],
            "parallel_config = cfg 2 x tp 1 x cp 1 x ulysses 2 = 4: the product of the axes must equal the world size 2",
        ),
        (
            "heads",
            "model:\n  preset: wan2.1-t2v-1.3b\nparallel_config:\n  ulysses_size: 8\n",
            &[],
            "parallel_config.ulysses_size = 8: must divide the model's head count 12",
        ),
        (
            "exclusive",
            "model:\n  preset: tiny\nparallel_config:\n  ring_size: 2\n  attn2d_size: [1, 2]\n",
            &[],
            "parallel_config.ring_size = 2: ring and attn2d_size [1, 2] are exclusive",
        ),
        (
            "negative",
            "model:\n  preset: tiny\nparallel_config:\n  parallel_vae_size: -4\n",
            &[],
            "parallel_config.parallel_vae_size = -4: must be at least 1",
        ),
        (
            "malformed",
            "model:\n  preset: tiny\n parallel_config: [\n",
            &[],
            "line",
        ),
        (
            "tp",
            "model:\n  preset: tiny\nparallel_config:\n  tp_size: 2\n",
            &[],
            "parallel_config.tp_size = 2",
        ),
        (
            "video",
            "model:\n  preset: tiny\n",
            &["--video", "808x480x81"],
            "--video \"808x480x81\": width and height must be positive multiples of 16",
        ),
    ];
    for (name, yaml, extra, expected) in cases {
        let (ok, stdout, stderr) = plan_yaml(name, yaml, extra);
        assert!(!ok, "{name}: expected failure, got\n{stdout}");
        assert!(
            stdout.is_empty(),
            "{name}: printed a plan before failing: {stdout}"
        );
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{name}: expected one line, got {stderr:?}");
        assert!(
            lines[0].starts_with("error: ") && lines[0].contains(expected),
            "{name}: {stderr}"
        );
    }
    let out = plan(&["--config", "configs/does-not-exist.yaml"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("cannot read config configs/does-not-exist.yaml")
    );
}
