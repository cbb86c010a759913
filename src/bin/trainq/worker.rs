//! `trainq worker`: the training daemon for one model on this machine.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use tokio_util::sync::CancellationToken;
use trainq::worker::{default_worker_id, run_worker, ConfigOverrides, WorkerOptions};
use trainq_engine::engine::Placement;
use trainq_queue::storage::RetentionPolicy;

/// Settings of `trainq worker`; each flag can also come from the environment (TRAINQ_*).
#[derive(Args, Debug)]
pub(crate) struct WorkerArgs {
    /// PostgreSQL connection URL.
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    /// Model to train (created with `trainq model create`).
    #[arg(long, env = "TRAINQ_MODEL")]
    model: String,
    /// Object store for checkpoints: s3://bucket/prefix, gs://…, az://…, file:///dir, memory://.
    #[arg(long, env = "TRAINQ_STORE")]
    store: String,
    /// Training device: `cuda` (GPU 0), `cuda:N`, or `cpu`. Default: cuda when available.
    #[arg(long, env = "TRAINQ_DEVICE")]
    device: Option<String>,
    /// Data-parallel training on this host's GPUs: `all` or a count N (the first N). Each GPU
    /// holds a replica; each step's micro-batches are split across them and gradients summed
    /// through NCCL. Overrides --device. Keep NCCL_NVLS_ENABLE=0 set on shared NVLink hosts.
    #[arg(long, env = "TRAINQ_GPUS")]
    gpus: Option<String>,
    /// Accept groups sampled from older checkpoints, up to --max-staleness steps old.
    #[arg(long, env = "TRAINQ_ASYNC_WEIGHT_SYNCING")]
    async_weight_syncing: Option<Option<bool>>,
    /// Largest accepted policy lag when async weight syncing is on.
    #[arg(long, env = "TRAINQ_MAX_STALENESS")]
    max_staleness: Option<i64>,
    /// Groups claimed per step.
    #[arg(long, env = "TRAINQ_GROUPS_PER_STEP")]
    groups_per_step: Option<usize>,
    /// A JSON file of worker settings (same keys as these flags, snake_case); flags win.
    #[arg(long, env = "TRAINQ_WORKER_CONFIG")]
    config: Option<PathBuf>,
    /// Local work directory (base model copy, staged and fetched checkpoints).
    #[arg(long, env = "TRAINQ_WORK_DIR")]
    work_dir: Option<PathBuf>,
    /// This worker's id; default host:pid.
    #[arg(long, env = "TRAINQ_WORKER_ID")]
    worker_id: Option<String>,
    /// Stop after this many committed steps.
    #[arg(long)]
    max_steps: Option<u64>,
    /// Stop after this many seconds without pending groups.
    #[arg(long)]
    stop_when_idle: Option<f64>,
    /// Keep the last K checkpoints in the store…
    #[arg(long, env = "TRAINQ_KEEP_LAST")]
    keep_last: Option<usize>,
    /// …and every M-th step.
    #[arg(long, env = "TRAINQ_KEEP_EVERY")]
    keep_every: Option<u64>,
    /// Serve Prometheus metrics on this address, e.g. 0.0.0.0:9464 (GET /metrics). Off by default.
    #[arg(long, env = "TRAINQ_METRICS_ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
}

/// Settings read from `--config FILE`.
#[derive(serde::Deserialize, Default, Debug)]
#[serde(deny_unknown_fields)]
struct WorkerFile {
    device: Option<String>,
    gpus: Option<String>,
    async_weight_syncing: Option<bool>,
    max_staleness: Option<i64>,
    groups_per_step: Option<usize>,
    work_dir: Option<PathBuf>,
    keep_last: Option<usize>,
    keep_every: Option<u64>,
}

/// Parses `cuda`, `cuda:N` or `cpu`; none picks CUDA when available.
pub(crate) fn parse_device(text: Option<&str>) -> Result<tch::Device> {
    Ok(match text {
        None => tch::Device::cuda_if_available(),
        Some("cpu") => tch::Device::Cpu,
        Some("cuda") => tch::Device::Cuda(0),
        Some(other) => match other.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(n) => tch::Device::Cuda(n),
            None => anyhow::bail!("--device {other:?}: expected cpu, cuda or cuda:N"),
        },
    })
}

pub(crate) fn run(args: WorkerArgs) -> Result<()> {
    let file: WorkerFile = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
            serde_json::from_str(&text).with_context(|| format!("parse {}", path.display()))?
        }
        None => WorkerFile::default(),
    };
    let device = parse_device(args.device.as_deref().or(file.device.as_deref()))?;
    let mut opts = WorkerOptions::new(&args.model, &args.store, Placement::One(device));
    if let Some(gpus) = args.gpus.as_deref().or(file.gpus.as_deref()) {
        let visible = usize::try_from(tch::Cuda::device_count()).unwrap_or(0);
        let placement = Placement::from_gpus_flag(gpus, visible).map_err(anyhow::Error::msg)?;
        // `--gpus 1` with an explicit `--device cuda:N` keeps that device.
        if !(matches!(placement, Placement::One(_)) && device.is_cuda()) {
            opts.placement = placement;
        }
    }
    opts.worker_id = args.worker_id.unwrap_or_else(default_worker_id);
    if let Some(dir) = args.work_dir.or(file.work_dir) {
        opts.work_dir = dir;
    }
    opts.overrides = ConfigOverrides {
        groups_per_step: args.groups_per_step.or(file.groups_per_step),
        async_weight_syncing: args.async_weight_syncing.map(|v| v.unwrap_or(true)).or(file.async_weight_syncing),
        max_staleness: args.max_staleness.or(file.max_staleness),
        learning_rate: None,
    };
    opts.max_steps = args.max_steps;
    opts.stop_when_idle_for = args.stop_when_idle.map(Duration::from_secs_f64);
    opts.metrics_addr = args.metrics_addr;
    let defaults = RetentionPolicy::default();
    opts.retention = RetentionPolicy {
        keep_last: args.keep_last.or(file.keep_last).unwrap_or(defaults.keep_last),
        keep_every: args.keep_every.or(file.keep_every).unwrap_or(defaults.keep_every),
    };
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(8)
            .connect(&args.database_url)
            .await
            .context("connect to PostgreSQL")?;
        let cancel = CancellationToken::new();
        let on_signal = cancel.clone();
        tokio::spawn(async move {
            shutdown_signal().await;
            tracing::info!("shutdown requested: finishing or abandoning the current step");
            on_signal.cancel();
        });
        let summary = run_worker(&pool, &opts, cancel).await?;
        tracing::info!(
            steps = summary.steps.len(),
            all_skipped = summary.all_skipped_passes,
            abandoned = summary.abandoned,
            "worker stopped"
        );
        Ok(())
    })
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! { _ = ctrl_c => {}, _ = term.recv() => {} }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
