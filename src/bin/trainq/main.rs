//! The `trainq` command line: migrations, models, submission, status, workers, demo, benchmarks.
//! Built without the `engine` feature it keeps the commands that need no libtorch (migrate,
//! model, submit, status, steps, checkpoint fetch).

#[cfg(feature = "engine")]
mod bench;
#[cfg(feature = "engine")]
mod bench_check;
#[cfg(feature = "engine")]
mod bench_docs;
#[cfg(feature = "engine")]
mod bench_produce;
mod checkpoint;
mod database;
#[cfg(feature = "engine")]
mod demo;
mod follow;
mod model;
mod report;
mod report_page;
#[cfg(feature = "engine")]
mod score;
mod submit;
#[cfg(feature = "engine")]
mod worker;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// Reinforcement learning for language-model agents, fed from PostgreSQL.
#[derive(Parser)]
#[command(name = "trainq", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    #[cfg(feature = "engine")]
    /// Run the training worker for one model (the daemon of GPU boxes).
    Worker(worker::WorkerArgs),
    #[cfg(feature = "engine")]
    /// Run the whole loop locally: tiny model, toy task, local PostgreSQL, file:// store.
    Demo(demo::DemoArgs),
    #[cfg(feature = "engine")]
    /// Per-token log-probs of token sequences under a model (and adapter), as JSON lines.
    Score(score::ScoreArgs),
    /// Checkpoints in object storage (fetch).
    #[command(subcommand)]
    Checkpoint(checkpoint::CheckpointCommand),
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
    /// Charts of a model's run (reward, loss, KL, throughput, lag, skips, step time) as one
    /// self-contained HTML page and SVG files.
    Report(report_page::ReportArgs),
    /// Keep an inference host on a model's newest checkpoint: fetch each new one into
    /// DIR/{step}, swap DIR/current, tell vLLM or run a hook.
    Follow(follow::FollowArgs),
    #[cfg(feature = "engine")]
    /// Benchmarks (training throughput on GPU).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        #[cfg(feature = "engine")]
        Command::Worker(args) => worker::run(args),
        #[cfg(feature = "engine")]
        Command::Demo(args) => demo::run(args),
        #[cfg(feature = "engine")]
        Command::Score(args) => score::run(args),
        Command::Checkpoint(command) => checkpoint::run(command),
        Command::Migrate(args) => database::run_migrate(args),
        Command::Model(command) => model::run(command),
        Command::Submit(args) => submit::run(args),
        Command::Status(args) => report::run_status(args),
        Command::Steps(args) => report::run_steps(args),
        Command::Follow(args) => follow::run(args),
        Command::Report(args) => report_page::run(args),
        #[cfg(feature = "engine")]
        Command::Bench(command) => bench::run(command),
    }
}
