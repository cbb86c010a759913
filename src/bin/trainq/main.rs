//! The `trainq` command line: migrations, models, submission, status, workers, demo, benchmarks.

use anyhow::Result;
use clap::{Parser, Subcommand};

mod database;
mod model;
mod report;
mod submit;

/// Reinforcement learning for language-model agents, fed from PostgreSQL.
#[derive(Parser)]
#[command(name = "trainq", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install or upgrade schema `trainq` (tables, producer functions, roles).
    Migrate(database::MigrateArgs),
    /// Register and inspect models.
    #[command(subcommand)]
    Model(model::ModelCommand),
    /// Submit groups from a JSON Lines file (one group per line).
    Submit(submit::SubmitArgs),
    /// Queue depth per model (pending, claimed, trained, skipped by reason, failed) and workers.
    Status(report::StatusArgs),
    /// The recorded steps of a model.
    Steps(report::StepsArgs),
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
        Command::Migrate(args) => database::run_migrate(args),
        Command::Model(command) => model::run(command),
        Command::Submit(args) => submit::run(args),
        Command::Status(args) => report::run_status(args),
        Command::Steps(args) => report::run_steps(args),
    }
}
