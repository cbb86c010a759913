//! `trainq checkpoint …`: checkpoints in object storage, seen from the command line.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use trainq_queue::db::databases::redact_database_url;
use trainq_queue::db::steps::{checkpoint_at, latest_checkpoint};
use trainq_queue::storage::store::store_url_of;
use trainq_queue::storage::{fetch_checkpoint, latest_complete_step, read_manifest, FetchOptions, Store};
use trainq_queue::StepNumber;

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
    /// Where checkpoints live: s3://bucket/prefix, gs://…, az://…, file:///dir. Optional with
    /// --database-url: then the store of the checkpoint's recorded URI.
    #[arg(long, env = "TRAINQ_STORE")]
    store: Option<String>,
    /// PostgreSQL URL. When given, `latest` is the newest committed checkpoint
    /// (`trainq.latest_checkpoint`) and the store defaults to where it was uploaded.
    #[arg(long, env = "DATABASE_URL")]
    database_url: Option<String>,
    /// A step number, or `latest`: the newest committed checkpoint (with --database-url), else
    /// the highest step whose manifest exists in the store.
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
    let recorded = match &args.database_url {
        Some(url) => recorded_checkpoint(url, &model, &args.step).await?,
        None => None,
    };
    let store_url = match (&args.store, &recorded) {
        (Some(url), _) => url.clone(),
        (None, Some((step, uri, _))) => store_url_of(uri, &model, *step).context("pass --store")?,
        (None, None) => bail!("--store (or TRAINQ_STORE) is required without --database-url"),
    };
    let store = Store::open(&store_url).with_context(|| format!("opening store {store_url}"))?;
    let (step, expected_manifest_sha256) = match recorded {
        Some((step, _, sha256)) => (step, Some(sha256)),
        None => (resolve_step(&store, &model, &args.step).await?, None),
    };
    let manifest = read_manifest(&store, &model, step).await?;
    let bar = ProgressBar::new(manifest.total_bytes);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(format!("{model} step {step}"));
    // With a database, the manifest must be the one the commit recorded.
    let options = FetchOptions { replace_existing: args.force, expected_manifest_sha256, ..FetchOptions::default() };
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

/// With a database: the checkpoint row named by `step` (`latest` through
/// `trainq.latest_checkpoint`), as (step, recorded URI, recorded manifest sha256).
async fn recorded_checkpoint(
    database_url: &str,
    model: &str,
    step: &str,
) -> Result<Option<(StepNumber, String, String)>> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(database_url)
        .await
        .with_context(|| format!("connect to {}", redact_database_url(database_url)))?;
    let found = if step == "latest" {
        latest_checkpoint(&pool, model).await?.map(|c| (c.step, c.uri, c.sha256))
    } else {
        let step: i64 = step.parse().with_context(|| format!("--step {step:?} is neither a number nor `latest`"))?;
        checkpoint_at(&pool, model, StepNumber(step)).await?.map(|c| (c.step, c.uri, c.sha256))
    };
    pool.close().await;
    match found {
        Some(found) => Ok(Some(found)),
        None => bail!("model {model:?} has no committed checkpoint at step {step}"),
    }
}

/// The store URL a recorded checkpoint URI (`{store}/{model}/checkpoints/{step:06}/`) lives in.
async fn resolve_step(store: &Store, model: &str, step: &str) -> Result<StepNumber> {
    if step != "latest" {
        return step
            .parse()
            .map(StepNumber)
            .with_context(|| format!("--step {step:?} is neither a number nor `latest`"));
    }
    match latest_complete_step(store, model).await? {
        Some(step) => Ok(step),
        None => bail!("no complete checkpoint of model {model:?} in {}", store.url()),
    }
}
