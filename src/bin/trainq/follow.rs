//! `trainq follow --model NAME --dir DIR`: keep an inference host on the newest checkpoint.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;
use trainq::follow::{follow_checkpoints, FollowOptions, DEFAULT_KEEP};
use trainq_queue::db::databases::redact_database_url;

use crate::database::{block_on, DatabaseArgs};

/// How long the follower waits for a database connection before counting it as an error.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);

/// `trainq follow`.
#[derive(clap::Args, Debug)]
pub(crate) struct FollowArgs {
    /// The model to follow.
    #[arg(long)]
    model: String,
    /// Local directory: DIR/{step:06} per fetched step, DIR/current → the newest.
    #[arg(long)]
    dir: PathBuf,
    /// Step directories to keep.
    #[arg(long, default_value_t = DEFAULT_KEEP)]
    keep: usize,
    /// Read checkpoints from this store instead of the one in their recorded URI.
    #[arg(long, env = "TRAINQ_STORE")]
    store: Option<String>,
    /// vLLM base URL (e.g. http://127.0.0.1:8000): load each new adapter as NAME-step-NNNNNN
    /// with POST /v1/load_lora_adapter, then unload the previous one.
    #[arg(long, value_name = "URL")]
    vllm: Option<String>,
    /// Shell command run after each new checkpoint is in place, with TRAINQ_MODEL,
    /// TRAINQ_STEP, TRAINQ_CHECKPOINT_DIR and TRAINQ_ADAPTER_NAME set.
    #[arg(long, value_name = "CMD")]
    exec: Option<String>,
    /// Longest wait between retries after errors, in seconds.
    #[arg(long, default_value_t = 30.0)]
    max_backoff: f64,
    #[command(flatten)]
    db: DatabaseArgs,
}

/// Follows until SIGTERM or ctrl-C.
pub(crate) fn run(args: FollowArgs) -> Result<()> {
    block_on(async move {
        // Lazy: a database that is down at start is waited for like one that goes away later.
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_lazy(&args.db.database_url)
            .with_context(|| format!("parse --database-url {}", redact_database_url(&args.db.database_url)))?;
        let mut options = FollowOptions::new(&args.model, args.dir);
        options.keep = args.keep;
        options.store_url = args.store;
        options.vllm = args.vllm;
        options.exec = args.exec;
        options.max_backoff = Duration::from_secs_f64(args.max_backoff.max(0.0));
        let stop = CancellationToken::new();
        tokio::spawn(cancel_on_signal(stop.clone()));
        follow_checkpoints(&pool, &options, &stop).await?;
        Ok(())
    })
}

async fn cancel_on_signal(stop: CancellationToken) {
    #[cfg(unix)]
    {
        let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) else {
            return;
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
    tracing::info!("stopping");
    stop.cancel();
}
