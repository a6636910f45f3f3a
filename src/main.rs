//! The `ditstream` binary: parses the command line and hands each subcommand to the library
//! that owns it. Nothing here does work of its own.

use ditstream::{generate, plan, serve};

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
    /// Run the gRPC server (the embedded CPU default, or what `--config` describes).
    Serve {
        /// The deployment config (YAML); default: the built-in cpu-tiny config.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Listen address; default: the config's `serving.listen`.
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
    },
    /// Generate a video: stream it from a server into an MP4 file, showing progress.
    Generate(generate::GenerateArgs),
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // A server logs its requests; the client and `plan` print their own output and only warn.
    let default_level = if matches!(cli.command, Command::Serve { .. }) {
        "info"
    } else {
        "warn"
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_level.into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Plan {
            config,
            world,
            video,
        } => plan::run(&config, world, video.as_deref()),
        Command::Serve { config, listen } => {
            runtime().and_then(|rt| rt.block_on(serve::serve(config.as_deref(), listen)))
        }
        Command::Generate(args) => runtime().and_then(|rt| rt.block_on(generate::run(args))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
