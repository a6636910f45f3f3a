//! The `ditstream` binary: parses the command line and hands each subcommand to the library
//! that owns it. Nothing here does work of its own.

mod plan;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Disaggregated DiT/VAE streaming pipeline service for video diffusion.
#[derive(Parser)]
#[command(name = "ditstream", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a config and print the rank layout: coordinates, sequence shards, every group.
    Plan {
        /// The deployment config (YAML).
        #[arg(long)]
        config: PathBuf,
        /// Denoiser ranks the launcher will provide; defaults to the product of the config's axes.
        #[arg(long)]
        world: Option<usize>,
        /// Video size to shard, as WIDTHxHEIGHTxFRAMES; defaults to the config's `serving` size.
        #[arg(long)]
        video: Option<String>,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Plan {
            config,
            world,
            video,
        } => plan::run(&config, world, video.as_deref()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
