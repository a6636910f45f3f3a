//! The `ditstream` binary: parses the command line and hands each subcommand to the library
//! that owns it. Nothing here does work of its own.

use ditstream::{generate, plan, roles, serve};

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
    /// Run the gateway of a disaggregated deployment: the public API, routing to the pools.
    Gateway {
        /// The deployment config (YAML).
        #[arg(long)]
        config: PathBuf,
        /// Listen address; default: the config's `serving.listen`.
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
        /// The pool registry's listen address (mutual TLS); default: `pools.registry_listen`.
        #[arg(long)]
        registry_listen: Option<std::net::SocketAddr>,
    },
    /// Run a denoiser pool: text encoder and transformer; registers with the gateway.
    Denoiser {
        /// The deployment config (YAML).
        #[arg(long)]
        config: PathBuf,
    },
    /// Run a decoder instance: VAE and encoder behind a latent link; registers with the gateway.
    Decoder {
        /// The deployment config (YAML).
        #[arg(long)]
        config: PathBuf,
    },
    /// Write a development pool CA and a certificate for every internal hop (ca.pem, pool.pem,
    /// pool-key.pem).
    Certs {
        /// Output folder.
        #[arg(long)]
        out: PathBuf,
        /// Host names or IPs the certificate covers (repeatable).
        #[arg(long = "host", default_values_t = ["localhost".to_string(), "127.0.0.1".to_string()])]
        hosts: Vec<String>,
    },
    /// Manage the API keys file (`serving.api_keys`).
    #[command(subcommand)]
    Keys(KeysCommand),
}

#[derive(Subcommand)]
enum KeysCommand {
    /// Make a new key for NAME: its hash is appended to FILE, the key printed once.
    Add {
        /// The keys file (created if missing, readable by its owner only).
        #[arg(long)]
        file: PathBuf,
        /// Who the key is for; requests made with it belong to this name.
        #[arg(long)]
        name: String,
    },
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Servers (serve, the gateway, the pools) log admission, routing, completion and failure;
    // the client and `plan` print their own output and only warn.
    let default_level = match cli.command {
        Command::Serve { .. }
        | Command::Gateway { .. }
        | Command::Denoiser { .. }
        | Command::Decoder { .. } => "info",
        Command::Plan { .. } | Command::Generate(_) | Command::Certs { .. } | Command::Keys(_) => {
            "warn"
        }
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
        Command::Gateway {
            config,
            listen,
            registry_listen,
        } => runtime()
            .and_then(|rt| rt.block_on(roles::run_gateway(&config, listen, registry_listen))),
        Command::Denoiser { config } => {
            runtime().and_then(|rt| rt.block_on(roles::run_denoiser(&config)))
        }
        Command::Decoder { config } => {
            runtime().and_then(|rt| rt.block_on(roles::run_decoder(&config)))
        }
        Command::Certs { out, hosts } => roles::write_certs(&out, &hosts),
        Command::Keys(KeysCommand::Add { file, name }) => roles::add_key(&file, &name),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
