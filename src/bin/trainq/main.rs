//! The `trainq` command line: migrations, models, submission, status, workers, demo, benchmarks.

use anyhow::Result;
use clap::{Parser, Subcommand};

mod checkpoint;

/// Reinforcement learning for language-model agents, fed from PostgreSQL.
#[derive(Parser)]
#[command(name = "trainq", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Checkpoints in object storage (fetch).
    #[command(subcommand)]
    Checkpoint(checkpoint::CheckpointCommand),
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Checkpoint(command) => checkpoint::run(command),
    }
}
