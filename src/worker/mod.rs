//! The daemon loop: claim, filter, train, checkpoint, commit; graceful shutdown.
//!
//! [`run_worker`] loads the base model (and the latest committed checkpoint, to resume), then
//! repeats steps (`step.rs`): assemble a batch (wait, woken by LISTEN with a poll fallback, until
//! `groups_per_step` eligible groups are pending or the oldest has waited `max_batch_wait_seconds`),
//! claim it, drop the groups with nothing to learn, train on the engine thread while heartbeats
//! keep the lease, upload the checkpoint, and commit the step fenced on the claim token. With
//! async weight syncing these overlap across steps (`pipeline.rs`).

#[doc(hidden)]
pub mod fault_hook;
pub mod metrics;
mod options;
mod pipeline;
mod prepare;
mod record;
mod step;

pub use options::{
    default_worker_id, ConfigOverrides, WorkerOptions, DEFAULT_POLL_INTERVAL, DEFAULT_UPLOAD_RETRY_PAUSE,
};
pub use record::{summarize_claimed, summarize_trained, ClaimedGroupsSummary, TrainedGroupsSummary};
pub use step::StepOutcome;
pub use trainq_engine::engine::Placement;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::error::Result;
use step::{Committed, StepContext};
use trainq_engine::engine::Engine;
use trainq_engine::tokenize::ChatTokenizer;
use trainq_queue::config::TrainConfig;
use trainq_queue::db::models::get_model;
use trainq_queue::db::steps::{latest_checkpoint, mark_checkpoints_deleted};
use trainq_queue::db::workers::{register_worker, WorkerInfo};
use trainq_queue::queue::{spawn_rescuer, GroupWaiter};
use trainq_queue::storage::{
    apply_retention, fetch_checkpoint, read_vocab_size, resolve_base_model, FetchOptions, RetentionPolicy, Store,
};
use trainq_queue::StepNumber;

/// What a worker run did, for the caller (demo, tests) and the final log line.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkerSummary {
    /// Steps committed.
    pub steps: Vec<trainq_queue::db::steps::StepRecord>,
    /// Passes where every claimed group was skipped.
    pub all_skipped_passes: usize,
    /// Steps given up (lost claim, errors, shutdown).
    pub abandoned: usize,
}

/// Runs the worker until `cancel` fires, `max_steps` steps are committed, or it has been idle
/// for `stop_when_idle_for`.
pub async fn run_worker(pool: &PgPool, opts: &WorkerOptions, cancel: CancellationToken) -> Result<WorkerSummary> {
    let model = get_model(pool, &opts.model).await?;
    let cfg = opts.overrides.apply(model.config.clone());
    cfg.validate()?;
    check_retention_covers_staleness(&cfg, &opts.retention)?;
    let info = WorkerInfo {
        id: opts.worker_id.clone(),
        host: opts.worker_id.split(':').next().unwrap_or_default().to_string(),
        model: Some(opts.model.clone()),
        devices: serde_json::json!(opts.placement.device_names()),
    };
    register_worker(pool, &info).await?;
    let store = Store::open_with(&opts.store_url, &opts.store_options)?;
    let base_dir = resolve_base_model(&model.base, &opts.work_dir).await?;
    let vocab_size = read_vocab_size(&base_dir.to_string_lossy()).await?;
    let tokenizer =
        Arc::new(ChatTokenizer::from_dir(&base_dir)?.with_template_kwargs(cfg.chat_template_kwargs.clone()));
    let (engine_step, resume_dir) = stage_latest(pool, &store, opts).await?;
    let engine = Engine::start(&base_dir, &cfg, &opts.placement, resume_dir.as_deref()).await?;
    tracing::info!(model = %opts.model, worker = %opts.worker_id, step = %engine_step, "worker ready");

    let rescuer =
        spawn_rescuer(pool.clone(), Duration::from_secs_f64(cfg.queue.lease_seconds as f64 / 4.0), cancel.clone());
    let waiter = GroupWaiter::listen(pool, opts.poll_interval).await?;
    let metrics = metrics::start(pool, opts, &cancel).await?;
    let ctx = StepContext {
        pool,
        opts,
        cfg: &cfg,
        tokenizer,
        engine: &engine,
        store: &store,
        cancel: &cancel,
        vocab_size,
        committed: Mutex::new(Committed { step: engine_step, dir: resume_dir }),
    };
    let summary = pipeline::Pipeline::new(&ctx, waiter, metrics.as_deref(), engine_step).run().await?;
    cancel.cancel();
    let _ = rescuer.await;
    Ok(summary)
}

/// Logs a committed step, feeds the metrics endpoint and applies retention.
async fn record_commit(
    ctx: &StepContext<'_>,
    metrics: Option<&metrics::WorkerMetrics>,
    summary: &mut WorkerSummary,
    record: Box<trainq_queue::db::steps::StepRecord>,
) {
    log_step(&record);
    metrics.iter().for_each(|m| m.observe_step(&record));
    apply_and_record_retention(ctx.pool, ctx.store, ctx.opts).await;
    summary.steps.push(*record);
}

/// With async weight syncing, producers may sample from any of the last `max_staleness + 1`
/// checkpoints; retention must keep them all, or a producer would be told to load one that is
/// gone. Refused at worker start with the settings named.
fn check_retention_covers_staleness(cfg: &TrainConfig, retention: &RetentionPolicy) -> Result<()> {
    let kept = i64::try_from(retention.keep_last.max(1)).unwrap_or(i64::MAX);
    if cfg.queue.async_weight_syncing && kept <= cfg.queue.max_staleness {
        let message = format!(
            "keeps the last {kept} checkpoint(s), but queue.max_staleness = {} lets producers sample from the last {}: \
             set keep_last (--keep-last) above max_staleness, or lower queue.max_staleness",
            cfg.queue.max_staleness,
            cfg.queue.max_staleness + 1
        );
        return Err(trainq_queue::Error::config("retention.keep_last", message).into());
    }
    Ok(())
}

/// Deletes the checkpoints retention drops from the store and marks their rows deleted; a
/// failure only warns (the next commit tries again).
async fn apply_and_record_retention(pool: &PgPool, store: &Store, opts: &WorkerOptions) {
    let deleted = match apply_retention(store, &opts.model, &opts.retention).await {
        Ok(deleted) => deleted,
        Err(err) => return tracing::warn!(model = %opts.model, "retention failed: {err}"),
    };
    if deleted.is_empty() {
        return;
    }
    tracing::info!(model = %opts.model, ?deleted, "retention removed checkpoints");
    if let Err(err) = mark_checkpoints_deleted(pool, &opts.model, &deleted).await {
        tracing::warn!(model = %opts.model, "could not mark deleted checkpoints: {err}");
    }
}

/// Downloads the model's latest committed checkpoint into the work directory, if it has one;
/// returns its step (the base model's for none) and the local directory.
async fn stage_latest(pool: &PgPool, store: &Store, opts: &WorkerOptions) -> Result<(StepNumber, Option<PathBuf>)> {
    let Some(latest) = latest_checkpoint(pool, &opts.model).await? else {
        return Ok((StepNumber::BASE, None));
    };
    let dir = opts.work_dir.join("checkpoints").join(format!("{:06}", latest.step));
    if !dir.join(trainq_queue::storage::MANIFEST_FILE).is_file() {
        let options = FetchOptions { replace_existing: true, ..FetchOptions::default() };
        fetch_checkpoint(store, &opts.model, latest.step, &dir, &options, &|_| {}).await?;
    }
    Ok((latest.step, Some(dir)))
}

fn log_step(r: &trainq_queue::db::steps::StepRecord) {
    tracing::info!(
        model = %r.model,
        step = %r.step,
        groups = r.groups_trained,
        skipped = %r.groups_skipped,
        tokens = r.tokens,
        loss = r.loss.unwrap_or(f64::NAN),
        reward = r.reward_mean.unwrap_or(f64::NAN),
        lag = ?(r.policy_lag_min, r.policy_lag_max),
        "step committed: {}",
        r.checkpoint_uri.as_deref().unwrap_or("-")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retention_must_keep_every_checkpoint_a_producer_may_sample_from() {
        let mut cfg = TrainConfig::default();
        cfg.queue.max_staleness = 2;
        let keep = |keep_last| RetentionPolicy { keep_last, keep_every: 0 };
        // On-policy: only the latest checkpoint is sampled from.
        assert!(check_retention_covers_staleness(&cfg, &keep(1)).is_ok());
        cfg.queue.async_weight_syncing = true;
        let err = check_retention_covers_staleness(&cfg, &keep(2)).unwrap_err().to_string();
        assert!(err.contains("retention.keep_last") && err.contains("queue.max_staleness = 2"), "{err}");
        assert!(check_retention_covers_staleness(&cfg, &keep(3)).is_ok());
    }
}
