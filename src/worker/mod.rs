//! The daemon loop: claim, filter, train, checkpoint, commit; graceful shutdown.
//!
//! [`run_worker`] loads the base model (and the latest committed checkpoint, to resume), then
//! repeats [`step`]s: assemble a batch (wait, woken by LISTEN with a poll fallback, until
//! `groups_per_step` eligible groups are pending or the oldest has waited `max_batch_wait_seconds`),
//! claim it, drop the groups with nothing to learn, train on the engine thread while heartbeats
//! keep the lease, upload the checkpoint, and commit the step fenced on the claim token.

#[doc(hidden)]
pub mod fault_hook;
pub mod metrics;
mod options;
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
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::error::Result;
use step::{
    claim_and_train, give_back_saved, policy_window, upload_and_commit, BatchPlan, Committed, SavedStep, StepContext,
    Trained,
};
use trainq_engine::engine::Engine;
use trainq_engine::tokenize::ChatTokenizer;
use trainq_queue::config::TrainConfig;
use trainq_queue::db::models::get_model;
use trainq_queue::db::steps::{latest_checkpoint, mark_checkpoints_deleted};
use trainq_queue::db::workers::{heartbeat_worker, register_worker, WorkerInfo};
use trainq_queue::queue::{spawn_rescuer, BatchReadiness, GroupWaiter};
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
    let (mut engine_step, resume_dir) = stage_latest(pool, &store, opts).await?;
    let engine = Engine::start(&base_dir, &cfg, &opts.placement, resume_dir.as_deref()).await?;
    tracing::info!(model = %opts.model, worker = %opts.worker_id, step = %engine_step, "worker ready");

    let rescuer =
        spawn_rescuer(pool.clone(), Duration::from_secs_f64(cfg.queue.lease_seconds as f64 / 4.0), cancel.clone());
    let mut waiter = GroupWaiter::listen(pool, opts.poll_interval).await?;
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
    // With async weight syncing a step's upload and commit run while the next step assembles
    // and trains (producers accept lagging weights anyway); on-policy, the next batch can only
    // be sampled from the committed checkpoint, so steps run one after another.
    let overlap_commits = cfg.queue.async_weight_syncing;
    let mut pending: Option<Box<SavedStep>> = None;
    let mut summary = WorkerSummary::default();
    let mut idle_since = Instant::now();
    loop {
        let started = summary.steps.len() + usize::from(pending.is_some());
        let room = !cancel.is_cancelled() && opts.max_steps.is_none_or(|n| (started as u64) < n);
        if !room && pending.is_none() {
            break;
        }
        let previous = pending.take();
        if let Err(err) = heartbeat_worker(pool, &opts.worker_id).await {
            if let Some(saved) = previous {
                give_back_saved(&ctx, *saved).await;
            }
            return Err(err.into());
        }
        let current = match &previous {
            // Speculative: the step being committed is what the next one starts from.
            Some(saved) => saved.step(),
            None => {
                let current = get_model(pool, &opts.model).await?.current_step;
                if current != engine_step {
                    // Another worker committed meanwhile: continue from its checkpoint.
                    let (step, dir) = stage_latest(pool, &store, opts).await?;
                    engine.restore(dir.as_deref()).await?;
                    ctx.set_committed(step, dir);
                    engine_step = step;
                }
                current
            }
        };
        let finish = async {
            match previous {
                Some(saved) => Some(upload_and_commit(&ctx, *saved).await),
                None => None,
            }
        };
        let next = async {
            match room {
                true => assemble_and_train(&ctx, &mut waiter, current).await,
                false => Ok(Next::Nothing),
            }
        };
        let (finished, next) = tokio::join!(finish, next);

        // Whether the engine holds weights that will not be committed.
        let mut restore = false;
        if let Some(finished) = finished {
            idle_since = Instant::now();
            match finished {
                StepOutcome::Committed(record) => {
                    engine_step = record.step;
                    record_commit(&ctx, metrics.as_deref(), &mut summary, record).await;
                }
                _abandoned => {
                    summary.abandoned += 1;
                    restore = true;
                }
            }
        }
        match next? {
            Next::Stop => break,
            Next::Moved => {}
            Next::Nothing => {
                if opts.stop_when_idle_for.is_some_and(|limit| idle_since.elapsed() >= limit) {
                    tracing::info!(model = %opts.model, "idle for {:?}: stopping", idle_since.elapsed());
                    break;
                }
            }
            Next::Pass(Trained::Done(StepOutcome::Idle)) => {}
            Next::Pass(Trained::Done(outcome)) => {
                idle_since = Instant::now();
                match outcome {
                    StepOutcome::AllSkipped { .. } => summary.all_skipped_passes += 1,
                    _abandoned => {
                        summary.abandoned += 1;
                        restore = true;
                    }
                }
            }
            Next::Pass(Trained::Saved(saved)) => {
                idle_since = Instant::now();
                if restore {
                    // Trained on top of a step that was not committed.
                    give_back_saved(&ctx, *saved).await;
                    summary.abandoned += 1;
                } else if overlap_commits {
                    pending = Some(saved);
                } else {
                    match upload_and_commit(&ctx, *saved).await {
                        StepOutcome::Committed(record) => {
                            engine_step = record.step;
                            record_commit(&ctx, metrics.as_deref(), &mut summary, record).await;
                        }
                        _abandoned => {
                            summary.abandoned += 1;
                            restore = true;
                        }
                    }
                }
            }
        }
        if restore {
            engine_step = ctx.restore_engine().await?;
        }
    }
    cancel.cancel();
    let _ = rescuer.await;
    Ok(summary)
}

/// What the loop's next pass came to, before any upload.
enum Next {
    /// Shutdown was asked for while waiting.
    Stop,
    /// Nothing eligible arrived within the poll interval.
    Nothing,
    /// Another worker committed a step: look again.
    Moved,
    /// A batch was claimed: how far its step got.
    Pass(Trained),
}

/// Assembles a batch for the step after `current` (waiting, woken by LISTEN, until
/// `groups_per_step` eligible groups are pending or the oldest has waited
/// `max_batch_wait_seconds`), then claims, trains and saves it.
async fn assemble_and_train(ctx: &StepContext<'_>, waiter: &mut GroupWaiter, current: StepNumber) -> Result<Next> {
    let (cfg, opts) = (ctx.cfg, ctx.opts);
    let waited = Instant::now();
    let want = cfg.queue.groups_per_step as i64;
    let max_wait = Duration::from_secs_f64(cfg.queue.max_batch_wait_seconds);
    let window = policy_window(cfg, current);
    let ready = tokio::select! {
        _ = ctx.cancel.cancelled() => return Ok(Next::Stop),
        ready = waiter.wait_for_batch(&opts.model, &window, want, max_wait, opts.poll_interval) => ready?,
    };
    let eligible_limit = match ready {
        BatchReadiness::Nothing => return Ok(Next::Nothing),
        BatchReadiness::StepMoved => return Ok(Next::Moved),
        BatchReadiness::TooOldOnly { .. } => 0,
        BatchReadiness::Full { .. } => want,
        BatchReadiness::Short { eligible, waited_seconds } => {
            tracing::info!(
                model = %opts.model,
                "short batch: {eligible} of {want} eligible group(s) after {waited_seconds:.1}s \
                 (queue.max_batch_wait_seconds = {})",
                cfg.queue.max_batch_wait_seconds
            );
            want
        }
    };
    let plan = BatchPlan { eligible_limit, wait_s: waited.elapsed().as_secs_f64() };
    Ok(Next::Pass(claim_and_train(ctx, current, plan).await?))
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
