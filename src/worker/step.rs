//! One worker step, in the order of DESIGN §3: claim → filter → train → checkpoint → commit,
//! every write after the claim fenced on its token. Any failure before the commit gives the
//! groups back (attempts + 1) and puts the engine back on the last committed weights.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::options::WorkerOptions;
use super::prepare::{prepare_step, PreparedStep};
use super::record::{summarize_claimed, summarize_trained};
use crate::error::{Error, Result};
use trainq_engine::engine::Engine;
use trainq_engine::tokenize::{ChatTokenizer, MicroBatch};
use trainq_engine::train::StepMetrics;
use trainq_queue::config::TrainConfig;
use trainq_queue::db::claims::{claim_groups, release_groups, unclaim_groups, Claim, ClaimParams, PolicyWindow};
use trainq_queue::db::commit_lock::{lock_commits, CommitLock};
use trainq_queue::db::skipped_passes::{record_skipped_pass, SkippedPass};
use trainq_queue::db::steps::{commit_step, CheckpointRecord, StepRecord};
use trainq_queue::queue::{spawn_lease_heartbeat, LeaseHeartbeat};
use trainq_queue::storage::{upload_checkpoint, Store, UploadOptions, UploadedCheckpoint};
use trainq_queue::StepNumber;

/// What one pass of the loop did.
#[derive(Debug, Clone, PartialEq)]
pub enum StepOutcome {
    /// Nothing was pending.
    Idle,
    /// Every claimed group was filtered out: no step was taken.
    AllSkipped {
        /// Groups skipped.
        groups: usize,
    },
    /// A step was trained, uploaded and committed.
    Committed(Box<StepRecord>),
    /// The step was given up (lost claim, shutdown or error); its groups went back or on.
    Abandoned {
        /// Why.
        reason: String,
    },
}

/// Everything a step needs that outlives it.
pub(crate) struct StepContext<'a> {
    pub pool: &'a PgPool,
    pub opts: &'a WorkerOptions,
    pub cfg: &'a TrainConfig,
    pub tokenizer: Arc<ChatTokenizer>,
    pub engine: &'a Engine,
    pub store: &'a Store,
    pub cancel: &'a CancellationToken,
    /// The base model's vocabulary size (config.json), if known: a group with token ids beyond
    /// it is skipped `invalid` instead of failing the step.
    pub vocab_size: Option<i64>,
    /// The last committed step and its checkpoint staged locally (None: the base weights).
    /// Behind a lock because a step's commit may finish while the next step trains.
    pub committed: Mutex<Committed>,
}

/// The last committed step and where its checkpoint lies locally.
#[derive(Debug, Clone, Default)]
pub(crate) struct Committed {
    pub step: StepNumber,
    /// None: the base weights.
    pub dir: Option<PathBuf>,
}

impl StepContext<'_> {
    /// The last committed step and its local checkpoint.
    pub(super) fn committed(&self) -> Committed {
        self.committed.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Records a commit (or another worker's commit, staged here); the previous staged
    /// checkpoint is deleted when it was one of ours.
    pub(super) fn set_committed(&self, step: StepNumber, dir: Option<PathBuf>) {
        let previous =
            std::mem::replace(&mut *self.committed.lock().unwrap_or_else(|p| p.into_inner()), Committed { step, dir });
        if let Some(previous) = previous.dir {
            if previous.starts_with(self.opts.work_dir.join("staging")) {
                let _ = std::fs::remove_dir_all(previous);
            }
        }
    }

    /// Puts the engine back on the committed weights; returns their step.
    pub(super) async fn restore_engine(&self) -> Result<StepNumber> {
        let committed = self.committed();
        self.engine.restore(committed.dir.as_deref()).await?;
        Ok(committed.step)
    }
}

/// The groups a step from checkpoint `current_step` may train (DESIGN §5b); up to a step's
/// worth of too-old groups ride along to be skipped `stale` with it.
pub(crate) fn policy_window(cfg: &TrainConfig, current_step: StepNumber) -> PolicyWindow {
    PolicyWindow {
        current_step,
        accepted_staleness: cfg.accepted_staleness(),
        unknown_policy_version: cfg.queue.unknown_policy_version,
        too_old_limit: cfg.queue.groups_per_step as i64,
    }
}

/// What the batch assembly decided before a step claims.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct BatchPlan {
    /// Eligible groups to claim: `groups_per_step`, or 0 to claim only too-old groups.
    pub eligible_limit: i64,
    /// Seconds spent waiting for the batch.
    pub wait_s: f64,
}

/// A claimed step, trained and saved locally; its upload and commit are still to come.
pub(crate) struct SavedStep {
    run: StepRun,
    heartbeat: LeaseHeartbeat,
    prepared: PreparedStep,
    trained: TrainedStep,
}

impl SavedStep {
    /// The step number this step commits as.
    pub(super) fn step(&self) -> StepNumber {
        self.trained.step
    }
}

/// A claimed step, prepared (filtered, tokenized, packed) and not yet trained. With async
/// weight syncing the next step's batch is claimed and prepared while this one trains.
pub(crate) struct ReadyStep {
    run: StepRun,
    heartbeat: LeaseHeartbeat,
    prepared: PreparedStep,
    prepare_s: f64,
}

impl ReadyStep {
    /// The step number this step commits as.
    pub(super) fn step(&self) -> StepNumber {
        self.run.current_step.next()
    }
}

/// How far [`claim_and_prepare`] got.
pub(crate) enum Claimed {
    /// Nothing to train: nothing claimed, every group skipped, or given up.
    Done(StepOutcome),
    /// Ready for [`train_and_save`].
    Ready(Box<ReadyStep>),
}

/// How far [`train_and_save`] got.
pub(crate) enum Trained {
    /// Given up before a checkpoint was saved (its groups handed back, the reason logged).
    Abandoned,
    /// Saved locally: [`upload_and_commit`] finishes it.
    Saved(Box<SavedStep>),
}

/// Claims and prepares one step from checkpoint `current`. A step given up on the way hands its
/// groups back.
pub(crate) async fn claim_and_prepare(ctx: &StepContext<'_>, current: StepNumber, plan: BatchPlan) -> Result<Claimed> {
    let current_step = current;
    let started_at = Utc::now();
    let clock = Instant::now();
    let claim = claim_groups(
        ctx.pool,
        &ClaimParams {
            model: ctx.opts.model.clone(),
            worker_id: ctx.opts.worker_id.clone(),
            limit: plan.eligible_limit,
            lease_seconds: ctx.cfg.queue.lease_seconds as f64,
            now: None,
            window: Some(policy_window(ctx.cfg, current_step)),
        },
    )
    .await?;
    if claim.groups.is_empty() {
        return Ok(Claimed::Done(StepOutcome::Idle));
    }
    let lease = ctx.cfg.queue.lease_seconds as f64;
    // Fires on shutdown, or when the heartbeat finds the claim lost: training stops after its
    // current micro-batch and an upload in flight is dropped.
    let stop = ctx.cancel.child_token();
    let every = Duration::from_secs_f64(lease / 3.0);
    let heartbeat = spawn_lease_heartbeat(ctx.pool.clone(), claim.token, lease, every, stop.clone());
    let claim_s = clock.elapsed().as_secs_f64();
    let run = StepRun { claim, stop, current_step, started_at, claim_s, wait_s: plan.wait_s };
    match prepare(ctx, &run).await {
        Ok(Some((prepared, prepare_s))) => {
            Ok(Claimed::Ready(Box::new(ReadyStep { run, heartbeat, prepared: *prepared, prepare_s })))
        }
        Ok(None) => {
            let _ = heartbeat.stop().await;
            Ok(Claimed::Done(StepOutcome::AllSkipped { groups: run.claim.groups.len() }))
        }
        Err(err) => {
            let outcome = give_back(ctx, &run.claim, run.explain(ctx, err)).await;
            let _ = heartbeat.stop().await;
            Ok(Claimed::Done(outcome))
        }
    }
}

/// Trains a prepared step and saves its checkpoint locally. A step given up on the way hands
/// its groups back; the engine is left as it is (the caller restores it).
pub(crate) async fn train_and_save(ctx: &StepContext<'_>, ready: ReadyStep) -> Trained {
    let ReadyStep { run, heartbeat, mut prepared, prepare_s } = ready;
    match train_save(ctx, &run, &mut prepared, prepare_s).await {
        Ok(trained) => Trained::Saved(Box::new(SavedStep { run, heartbeat, prepared, trained })),
        Err(err) => {
            give_back(ctx, &run.claim, run.explain(ctx, err)).await;
            let _ = heartbeat.stop().await;
            Trained::Abandoned
        }
    }
}

/// One claimed step in flight.
struct StepRun {
    claim: Claim,
    /// Cancelled on shutdown or when the claim is lost.
    stop: CancellationToken,
    current_step: StepNumber,
    started_at: chrono::DateTime<Utc>,
    claim_s: f64,
    /// Seconds spent assembling the batch before the claim.
    wait_s: f64,
}

impl StepRun {
    /// Shutdown or a lost claim, when the step was stopped; `Ok` otherwise.
    fn check(&self, ctx: &StepContext<'_>) -> Result<()> {
        match self.stop.is_cancelled() {
            true => Err(self.stop_reason(ctx)),
            false => Ok(()),
        }
    }

    fn stop_reason(&self, ctx: &StepContext<'_>) -> Error {
        if ctx.cancel.is_cancelled() {
            return Error::Shutdown;
        }
        let (model, groups) = (ctx.opts.model.clone(), self.claim.groups.len());
        Error::Queue(trainq_queue::Error::LostClaim { model, groups })
    }

    /// An engine error caused by the stop is reported as the stop's reason.
    fn explain(&self, ctx: &StepContext<'_>, err: Error) -> Error {
        match err {
            Error::Engine(trainq_engine::Error::Cancelled) => self.stop_reason(ctx),
            other => other,
        }
    }
}

/// Filters, tokenizes and packs the claimed groups on a blocking thread; `None` when every
/// group was skipped (recorded as a skipped pass).
async fn prepare(ctx: &StepContext<'_>, run: &StepRun) -> Result<Option<(Box<PreparedStep>, f64)>> {
    let (claim, current_step, started_at) = (&run.claim, run.current_step, run.started_at);
    let clock = Instant::now();
    let (groups, cfg, tokenizer, vocab) =
        (claim.groups.clone(), ctx.cfg.clone(), ctx.tokenizer.clone(), ctx.vocab_size);
    let prepared = tokio::task::spawn_blocking(move || prepare_step(&groups, &cfg, current_step, &tokenizer, vocab))
        .await
        .map_err(Error::task("tokenizer task"))??;
    let prepare_s = clock.elapsed().as_secs_f64();
    tracing::info!(model = %ctx.opts.model, step = %current_step.next(), "{}", prepared.report);
    if prepared.report.kept.is_empty() {
        let pass = skipped_pass(ctx, claim, &prepared, current_step, started_at);
        record_skipped_pass(ctx.pool, claim.token, &pass, &prepared.report.skipped).await?;
        tracing::info!(
            model = %ctx.opts.model,
            "no step taken: all {} claimed group(s) were skipped; waiting for more",
            claim.groups.len()
        );
        return Ok(None);
    }
    Ok(Some((Box::new(prepared), prepare_s)))
}

async fn train_save(
    ctx: &StepContext<'_>,
    run: &StepRun,
    prepared: &mut PreparedStep,
    prepare_s: f64,
) -> Result<TrainedStep> {
    let (current_step, started_at, claim_s) = (run.current_step, run.started_at, run.claim_s);
    run.check(ctx)?;
    super::fault_hook::pause_if_requested("train", current_step.next()).await;
    let clock = Instant::now();
    let real_tokens: usize = prepared.batches.iter().map(MicroBatch::real_tokens).sum();
    let metrics = ctx.engine.train(std::mem::take(&mut prepared.batches), &run.stop).await?;
    let train_s = clock.elapsed().as_secs_f64();
    run.check(ctx)?;

    let step = current_step.next();
    let clock = Instant::now();
    let staged = ctx.opts.work_dir.join("staging").join(format!("{step:06}"));
    let _ = std::fs::remove_dir_all(&staged);
    std::fs::create_dir_all(&staged).map_err(trainq_queue::Error::io(&staged))?;
    let format = ctx.engine.save(&staged).await?;
    let save_s = clock.elapsed().as_secs_f64();

    let timings =
        json!({"batch_wait": run.wait_s, "claim": claim_s, "prepare": prepare_s, "train": train_s, "save": save_s});
    Ok(TrainedStep { step, started_at, timings, metrics, real_tokens, format, staged })
}

/// A trained step, saved locally and not yet uploaded.
struct TrainedStep {
    step: StepNumber,
    started_at: chrono::DateTime<Utc>,
    /// Seconds of the phases so far (claim, prepare, train, save).
    timings: serde_json::Value,
    metrics: StepMetrics,
    /// Real (non-padding) tokens of the step's micro-batches.
    real_tokens: usize,
    format: trainq_queue::storage::CheckpointFormat,
    staged: PathBuf,
}

/// Uploads a saved step's checkpoint and commits the step, fenced on its claim; a failure hands
/// the groups back (the engine is left as it is: the caller restores it on `Abandoned`).
pub(crate) async fn upload_and_commit(ctx: &StepContext<'_>, saved: SavedStep) -> StepOutcome {
    let SavedStep { run, heartbeat, prepared, trained } = saved;
    super::fault_hook::pause_if_requested("upload", trained.step).await;
    // Held through upload and commit: no other worker of this model writes step `step` meanwhile.
    // Waiting for it (another worker may hold it through a long upload) ends on shutdown or a
    // lost claim; the lock's connection is its own, so dropping the wait closes it.
    let locked = tokio::select! {
        _ = run.stop.cancelled() => Err(run.stop_reason(ctx)),
        lock = lock_commits(ctx.pool, &ctx.opts.model) => lock.map_err(Error::from),
    };
    let committed = match locked {
        Ok(mut lock) => {
            let committed = commit_locked(ctx, &run, &prepared, trained, &mut lock).await;
            lock.release().await;
            committed
        }
        Err(err) => Err(err),
    };
    let outcome = match committed {
        Ok(outcome) => outcome,
        Err(err) => give_back(ctx, &run.claim, run.explain(ctx, err)).await,
    };
    let _ = heartbeat.stop().await;
    outcome
}

/// Uploads the staged checkpoint and commits the step, unless another worker committed this
/// step number first (then the step is given up before touching that checkpoint's objects).
async fn commit_locked(
    ctx: &StepContext<'_>,
    run: &StepRun,
    prepared: &PreparedStep,
    trained: TrainedStep,
    lock: &mut CommitLock,
) -> Result<StepOutcome> {
    let TrainedStep { step, started_at, mut timings, metrics, real_tokens, format, staged } = trained;
    let claim = &run.claim;
    let now_at = lock.current_step().await?;
    if now_at.next() != step {
        let model = ctx.opts.model.clone();
        return Err(trainq_queue::Error::StepTaken { model, step, now_at }.into());
    }
    let clock = Instant::now();
    let uploaded = upload_with_retry(ctx, run, step, format, &staged).await?;
    timings["upload"] = json!(clock.elapsed().as_secs_f64());

    let mut record = step_record(ctx, claim, prepared, &metrics, step, started_at, timings, &uploaded);
    record.loss_parts["real_tokens"] = json!(real_tokens);
    let checkpoint = CheckpointRecord {
        model: ctx.opts.model.clone(),
        step,
        uri: uploaded.uri.clone(),
        format: format.as_str().to_string(),
        bytes: uploaded.total_bytes as i64,
        sha256: uploaded.manifest_sha256.clone(),
        manifest: serde_json::to_value(&uploaded.manifest).map_err(trainq_queue::Error::json("manifest"))?,
    };
    let clock = Instant::now();
    commit_step(ctx.pool, &record, Some(&checkpoint), claim.token, &prepared.report.kept, &prepared.report.skipped)
        .await?;
    record.timings["commit"] = json!(clock.elapsed().as_secs_f64());
    ctx.set_committed(step, Some(staged));
    Ok(StepOutcome::Committed(Box::new(record)))
}

/// Uploads the staged checkpoint, retrying while the store is unreachable (the claim's lease is
/// kept alive meanwhile); gives up on shutdown or when the claim is lost, mid-transfer too.
async fn upload_with_retry(
    ctx: &StepContext<'_>,
    run: &StepRun,
    step: StepNumber,
    format: trainq_queue::storage::CheckpointFormat,
    staged: &std::path::Path,
) -> Result<UploadedCheckpoint> {
    let options = UploadOptions::default();
    loop {
        let upload = upload_checkpoint(ctx.store, &ctx.opts.model, step, format, staged, &options, &|_| {});
        let attempt = tokio::select! {
            _ = run.stop.cancelled() => return Err(run.stop_reason(ctx)),
            attempt = upload => attempt,
        };
        match attempt {
            Ok(uploaded) => return Ok(uploaded),
            Err(err) => {
                tracing::warn!(model = %ctx.opts.model, %step, "upload failed, retrying: {err}");
                tokio::select! {
                    _ = run.stop.cancelled() => return Err(run.stop_reason(ctx)),
                    _ = tokio::time::sleep(ctx.opts.upload_retry_pause) => {}
                }
            }
        }
    }
}

/// Gives a prepared step's groups back because the step it was to train on top of was not
/// trained or committed.
pub(crate) async fn give_back_ready(ctx: &StepContext<'_>, ready: ReadyStep) -> StepOutcome {
    let previous = ready.run.current_step;
    let outcome = give_back(ctx, &ready.run.claim, Error::PreviousStepNotCommitted { step: previous }).await;
    let _ = ready.heartbeat.stop().await;
    outcome
}

/// Gives a saved step's groups back because the step before it, committed in the background,
/// was not; its checkpoint is never uploaded.
pub(crate) async fn give_back_saved(ctx: &StepContext<'_>, saved: SavedStep) -> StepOutcome {
    let SavedStep { run, heartbeat, trained, .. } = saved;
    let previous = StepNumber(trained.step.get() - 1);
    let outcome = give_back(ctx, &run.claim, Error::PreviousStepNotCommitted { step: previous }).await;
    let _ = heartbeat.stop().await;
    let _ = std::fs::remove_dir_all(&trained.staged);
    outcome
}

/// Gives the claim's groups back after `err`. A shutdown, a lost commit race or an uncommitted
/// previous step is not the groups' fault: no attempt is counted. A lost claim has nothing left.
async fn give_back(ctx: &StepContext<'_>, claim: &Claim, err: Error) -> StepOutcome {
    let reason = err.to_string();
    tracing::warn!(model = %ctx.opts.model, claim = %claim.token, "step abandoned: {reason}");
    let ids: Vec<_> = claim.groups.iter().map(|g| g.id).collect();
    let released = match &err {
        Error::Shutdown
        | Error::PreviousStepNotCommitted { .. }
        | Error::Queue(trainq_queue::Error::StepTaken { .. }) => unclaim_groups(ctx.pool, claim.token, &ids).await,
        Error::Queue(trainq_queue::Error::LostClaim { .. }) => Ok(()),
        _ => release_groups(ctx.pool, claim.token, &ids, &reason).await,
    };
    match released {
        Ok(()) | Err(trainq_queue::Error::LostClaim { .. }) => {}
        Err(e) => tracing::warn!("could not release claim {}: {e} (the rescuer will)", claim.token),
    }
    StepOutcome::Abandoned { reason }
}

#[allow(clippy::too_many_arguments)]
fn step_record(
    ctx: &StepContext<'_>,
    claim: &Claim,
    prepared: &PreparedStep,
    metrics: &StepMetrics,
    step: StepNumber,
    started_at: chrono::DateTime<Utc>,
    timings: serde_json::Value,
    uploaded: &UploadedCheckpoint,
) -> StepRecord {
    let summary = summarize_trained(&prepared.trained, StepNumber(step.get() - 1));
    let claimed = summarize_claimed(&claimed_rewards(claim, prepared));
    StepRecord {
        model: ctx.opts.model.clone(),
        step,
        worker_id: ctx.opts.worker_id.clone(),
        async_weight_syncing: ctx.cfg.queue.async_weight_syncing,
        started_at,
        finished_at: Utc::now(),
        groups_claimed: claim.groups.len() as i32,
        groups_wanted: Some(ctx.cfg.queue.groups_per_step as i32),
        groups_trained: prepared.report.kept.len() as i32,
        groups_skipped: prepared.report.counts_json(),
        trajectories: prepared.trajectories as i32,
        tokens: prepared.tokens as i64,
        loss: Some(metrics.loss),
        loss_parts: json!({
            "policy_loss": metrics.policy_loss, "kl": metrics.kl, "clip_fraction": metrics.clip_fraction,
            "mean_ratio": metrics.mean_ratio, "micro_batches": metrics.micro_batches,
            "trajectories_truncated": prepared.left_out.truncated,
            "trajectories_masked": prepared.left_out.masked,
            "trajectories_zero_advantage_dropped": prepared.left_out.zero_advantage,
        }),
        grad_norm: Some(metrics.grad_norm),
        learning_rate: Some(metrics.lr),
        reward_mean: summary.reward_mean,
        reward_mean_claimed: claimed.reward_mean_claimed,
        reward_mean_skipped: claimed.reward_mean_skipped,
        logprob_coverage: (prepared.tokens > 0).then(|| prepared.logprob_tokens as f64 / prepared.tokens as f64),
        importance_ratio_mean: Some(metrics.mean_ratio),
        reward_std_mean: summary.reward_std_mean,
        policy_lag_min: summary.policy_lag_min,
        policy_lag_max: summary.policy_lag_max,
        timings,
        devices: json!(ctx.opts.placement.device_names()),
        checkpoint_uri: Some(uploaded.uri.clone()),
        checkpoint_sha256: Some(uploaded.manifest_sha256.clone()),
    }
}

/// Each claimed group's rewards, and whether the step skipped it.
fn claimed_rewards(claim: &Claim, prepared: &PreparedStep) -> Vec<(Vec<f64>, bool)> {
    claim.groups.iter().map(|g| (g.rewards(), !prepared.report.kept.contains(&g.id))).collect()
}

/// The record of a pass whose claimed groups were all skipped.
fn skipped_pass(
    ctx: &StepContext<'_>,
    claim: &Claim,
    prepared: &PreparedStep,
    current_step: StepNumber,
    started_at: chrono::DateTime<Utc>,
) -> SkippedPass {
    let claimed = summarize_claimed(&claimed_rewards(claim, prepared));
    SkippedPass {
        model: ctx.opts.model.clone(),
        current_step,
        worker_id: ctx.opts.worker_id.clone(),
        started_at,
        groups_claimed: claim.groups.len() as i32,
        groups_skipped: prepared.report.counts_json(),
        reward_mean_claimed: claimed.reward_mean_claimed,
        reward_std_mean: claimed.reward_std_mean_skipped,
    }
}
