//! `trainq checkpoint …`: checkpoints in object storage, seen from the command line.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use trainq::checkpoint::{fetch_checkpoint, latest_complete_step, read_manifest, FetchOptions, Store};

/// Checkpoint commands.
#[derive(Subcommand)]
pub(crate) enum CheckpointCommand {
    /// Download a checkpoint, verify every file's size and sha256 against its manifest, and
    /// leave a directory that peft / vLLM load as is.
    Fetch(FetchArgs),
}

/// Arguments of `trainq checkpoint fetch`.
#[derive(Args)]
pub(crate) struct FetchArgs {
    /// The model (also accepted as `--model`).
    #[arg(value_name = "NAME", required_unless_present = "model_flag", conflicts_with = "model_flag")]
    model: Option<String>,
    /// The model.
    #[arg(long = "model", value_name = "NAME")]
    model_flag: Option<String>,
    /// Where checkpoints live: s3://bucket/prefix, gs://…, az://…, file:///dir.
    #[arg(long, env = "TRAINQ_STORE")]
    store: String,
    /// A step number, or `latest`: the highest step whose manifest exists in the store.
    #[arg(long, default_value = "latest")]
    step: String,
    /// Destination directory; created, and must not hold files unless --force.
    #[arg(long)]
    to: PathBuf,
    /// Replace a non-empty destination.
    #[arg(long)]
    force: bool,
}

/// Runs a checkpoint command on its own tokio runtime.
pub(crate) fn run(command: CheckpointCommand) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    match command {
        CheckpointCommand::Fetch(args) => runtime.block_on(fetch(args)),
    }
}

async fn fetch(args: FetchArgs) -> Result<()> {
    let model = args.model.or(args.model_flag).expect("clap requires a model");
    let store = Store::open(&args.store).with_context(|| format!("opening store {}", args.store))?;
    let step = resolve_step(&store, &model, &args.step).await?;
    let manifest = read_manifest(&store, &model, step).await?;
    let bar = ProgressBar::new(manifest.total_bytes);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(format!("{model} step {step}"));
    let options = FetchOptions { replace_existing: args.force, ..FetchOptions::default() };
    let progress = |n: u64| bar.inc(n);
    let fetched = fetch_checkpoint(&store, &model, step, &args.to, &options, &progress).await;
    bar.finish_and_clear();
    let manifest = fetched?;
    println!(
        "fetched {model} step {step} ({}, {} files, {} bytes, sha256 verified) into {}",
        manifest.format.as_str(),
        manifest.files.len(),
        manifest.total_bytes,
        args.to.display()
    );
    Ok(())
}

/// `latest` → the highest step with a manifest in the store; otherwise a step number.
async fn resolve_step(store: &Store, model: &str, step: &str) -> Result<u64> {
    if step != "latest" {
        return step.parse().with_context(|| format!("--step {step:?} is neither a number nor `latest`"));
    }
    match latest_complete_step(store, model).await? {
        Some(step) => Ok(step),
        None => bail!("no complete checkpoint of model {model:?} in {}", store.url()),
    }
}
