//! The worker's step pipeline: which steps are in flight, and how one pass of the loop moves
//! each of them on.
//!
//! A step goes claim → prepare ([`ReadyStep`]) → train → save ([`SavedStep`]) → upload → commit.
//! With async weight syncing one pass does three things at once: it uploads and commits step
//! n, trains step n+1, and claims and prepares step n+2's batch (a full one only, while n+1
//! trains: the claim takes the oldest eligible groups, the same ones it would take after
//! training, so the GPU never waits on claiming or tokenizing). Every step commits in order; when
//! one is not committed, the steps after it are given back without counting an attempt and the
//! engine goes back to the committed weights. On-policy (async off) the producers can only
//! sample the next batch from the committed checkpoint, so steps run one after another.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::step::{
    claim_and_prepare, give_back_ready, give_back_saved, policy_window, train_and_save, upload_and_commit, BatchPlan,
    Claimed, ReadyStep, SavedStep, StepContext, Trained,
};
use super::{metrics, record_commit, stage_latest, StepOutcome, WorkerSummary};
use crate::error::Result;
use trainq_queue::db::models::get_model;
use trainq_queue::db::workers::heartbeat_worker;
use trainq_queue::queue::{BatchReadiness, GroupWaiter};
use trainq_queue::StepNumber;

/// The loop's state between passes.
pub(super) struct Pipeline<'c, 'a> {
    ctx: &'c StepContext<'a>,
    waiter: GroupWaiter,
    metrics: Option<&'c metrics::WorkerMetrics>,
    /// Whether steps overlap (async weight syncing).
    pipelined: bool,
    /// The step of the weights the engine holds once every step in flight is committed.
    engine_step: StepNumber,
    summary: WorkerSummary,
    /// Trained and saved, to upload and commit.
    saved: Option<Box<SavedStep>>,
    /// Claimed and prepared, to train.
    ready: Option<Box<ReadyStep>>,
    idle_since: Instant,
}

/// What the pass's claim came to.
enum Next {
    /// Shutdown was asked for while waiting.
    Stop,
    /// Nothing eligible arrived within the poll interval.
    Nothing,
    /// Another worker committed a step: look again.
    Moved,
    /// A batch was claimed: how far it got.
    Pass(Claimed),
}

impl<'c, 'a> Pipeline<'c, 'a> {
    pub(super) fn new(
        ctx: &'c StepContext<'a>,
        waiter: GroupWaiter,
        metrics: Option<&'c metrics::WorkerMetrics>,
        engine_step: StepNumber,
    ) -> Self {
        let pipelined = ctx.cfg.queue.async_weight_syncing;
        let summary = WorkerSummary::default();
        Pipeline {
            ctx,
            waiter,
            metrics,
            pipelined,
            engine_step,
            summary,
            saved: None,
            ready: None,
            idle_since: Instant::now(),
        }
    }

    /// Runs passes until shutdown, `max_steps` steps, or `stop_when_idle_for` of idleness; the
    /// steps in flight are finished (or given back) first.
    pub(super) async fn run(mut self) -> Result<WorkerSummary> {
        let opts = self.ctx.opts;
        loop {
            let in_flight = usize::from(self.saved.is_some()) + usize::from(self.ready.is_some());
            let started = (self.summary.steps.len() + in_flight) as u64;
            let room = !self.ctx.cancel.is_cancelled() && opts.max_steps.is_none_or(|n| started < n);
            if !room && in_flight == 0 {
                break;
            }
            let idle = self.pass(room).await?;
            let drained = self.saved.is_none() && self.ready.is_none();
            if idle && drained && opts.stop_when_idle_for.is_some_and(|limit| self.idle_since.elapsed() >= limit) {
                tracing::info!(model = %opts.model, "idle for {:?}: stopping", self.idle_since.elapsed());
                break;
            }
        }
        Ok(self.summary)
    }

    /// One pass: commit the saved step, train the ready one and claim the next batch, each when
    /// there is one (see the module docs); true when the claim found nothing to do.
    async fn pass(&mut self, room: bool) -> Result<bool> {
        let ctx = self.ctx;
        let (previous, batch) = (self.saved.take(), self.ready.take());
        if let Err(err) = heartbeat_worker(ctx.pool, &ctx.opts.worker_id).await {
            self.give_back(previous, batch).await;
            return Err(err.into());
        }
        // The step the next batch trains from: the newest in flight, else the model's.
        let current = match (&batch, &previous) {
            (Some(ready), _) => ready.step(),
            (None, Some(saved)) => saved.step(),
            (None, None) => self.catch_up().await?,
        };
        let claim_next = room && (self.pipelined || (batch.is_none() && previous.is_none()));
        // A window past the committed step: only batches that train are claimed in it.
        let speculative = batch.is_some() || previous.is_some();
        // Fires when this pass's training is over (at once when there is none).
        let trained_signal = CancellationToken::new();
        if batch.is_none() {
            trained_signal.cancel();
        }
        let waiter = &mut self.waiter;
        let finish = async {
            match previous {
                Some(saved) => Some(upload_and_commit(ctx, *saved).await),
                None => None,
            }
        };
        let train = async {
            let trained = match batch {
                Some(ready) => Some(train_and_save(ctx, *ready).await),
                None => None,
            };
            trained_signal.cancel();
            trained
        };
        let next = async {
            match claim_next {
                true => next_batch(ctx, waiter, current, speculative, &trained_signal).await.map(Some),
                false => Ok(None),
            }
        };
        let (finished, trained, next) = tokio::join!(finish, train, next);

        // Whether the engine holds weights that will not be committed.
        let mut restore = false;
        if let Some(outcome) = finished {
            self.idle_since = Instant::now();
            restore |= !self.committed(outcome).await;
        }
        if trained.is_some() {
            self.idle_since = Instant::now();
        }
        match trained {
            None => {}
            Some(Trained::Abandoned) => {
                self.summary.abandoned += 1;
                restore = true;
            }
            Some(Trained::Saved(saved)) if restore => {
                give_back_saved(ctx, *saved).await;
                self.summary.abandoned += 1;
            }
            Some(Trained::Saved(saved)) if self.pipelined => self.saved = Some(saved),
            Some(Trained::Saved(saved)) => restore |= !self.committed(upload_and_commit(ctx, *saved).await).await,
        }
        let next = match next {
            Ok(next) => next,
            Err(err) => {
                let (saved, ready) = (self.saved.take(), self.ready.take());
                self.give_back(saved, ready).await;
                return Err(err);
            }
        };
        let mut idle = false;
        match next {
            None | Some(Next::Stop | Next::Moved) => {}
            Some(Next::Nothing) => idle = true,
            Some(Next::Pass(Claimed::Done(StepOutcome::Idle))) => {}
            Some(Next::Pass(Claimed::Done(outcome))) => {
                self.idle_since = Instant::now();
                match outcome {
                    StepOutcome::AllSkipped { .. } => {
                        self.summary.all_skipped_passes += 1;
                        self.metrics.iter().for_each(|m| m.observe_skipped_pass());
                    }
                    _abandoned => self.summary.abandoned += 1,
                }
            }
            Some(Next::Pass(Claimed::Ready(ready))) if restore => {
                give_back_ready(ctx, *ready).await;
                self.summary.abandoned += 1;
            }
            Some(Next::Pass(Claimed::Ready(ready))) => {
                self.idle_since = Instant::now();
                self.ready = Some(ready);
            }
        }
        if restore {
            self.engine_step = ctx.restore_engine().await?;
        }
        Ok(idle)
    }

    /// Records a finished upload and commit; false when the step was not committed.
    async fn committed(&mut self, outcome: StepOutcome) -> bool {
        match outcome {
            StepOutcome::Committed(record) => {
                self.engine_step = record.step;
                record_commit(self.ctx, self.metrics, &mut self.summary, record).await;
                true
            }
            _abandoned => {
                self.summary.abandoned += 1;
                false
            }
        }
    }

    /// With nothing in flight: the model's current step, after loading another worker's newer
    /// checkpoint when one was committed meanwhile.
    async fn catch_up(&mut self) -> Result<StepNumber> {
        let ctx = self.ctx;
        let current = get_model(ctx.pool, &ctx.opts.model).await?.current_step;
        if current != self.engine_step {
            let (step, dir) = stage_latest(ctx.pool, ctx.store, ctx.opts).await?;
            ctx.engine.restore(dir.as_deref()).await?;
            ctx.set_committed(step, dir);
            self.engine_step = step;
        }
        Ok(current)
    }

    /// Hands back the steps in flight when the loop ends on an error.
    async fn give_back(&mut self, saved: Option<Box<SavedStep>>, ready: Option<Box<ReadyStep>>) {
        if let Some(saved) = saved {
            give_back_saved(self.ctx, *saved).await;
        }
        if let Some(ready) = ready {
            give_back_ready(self.ctx, *ready).await;
        }
    }
}

/// Claims and prepares the batch for the step after `current`. While a step trains
/// (`trained` not yet fired) only a full batch is taken, and when the training ends first the
/// pass ends (so the trained step's upload is not held up) and the next pass assembles as usual:
/// wait, woken by LISTEN, until `groups_per_step` eligible groups are pending or the oldest has
/// waited `max_batch_wait_seconds`. In a `speculative` window (the step before it is not yet
/// committed) groups that are only too old are left for a committed one: skipping them `stale`
/// is final, and the step they were judged against might not be committed.
async fn next_batch(
    ctx: &StepContext<'_>,
    waiter: &mut GroupWaiter,
    current: StepNumber,
    speculative: bool,
    trained: &CancellationToken,
) -> Result<Next> {
    let (cfg, opts) = (ctx.cfg, ctx.opts);
    let waited = Instant::now();
    let want = cfg.queue.groups_per_step as i64;
    let window = policy_window(cfg, current);
    if !trained.is_cancelled() {
        return match waiter.wait_for_full_batch(&opts.model, &window, want, trained).await? {
            Some(BatchReadiness::StepMoved) => Ok(Next::Moved),
            Some(_full) => claim(ctx, current, want, waited).await,
            None => Ok(Next::Nothing),
        };
    }
    let max_wait = Duration::from_secs_f64(cfg.queue.max_batch_wait_seconds);
    let ready = tokio::select! {
        _ = ctx.cancel.cancelled() => return Ok(Next::Stop),
        ready = waiter.wait_for_batch(&opts.model, &window, want, max_wait, opts.poll_interval) => ready?,
    };
    let eligible_limit = match ready {
        BatchReadiness::Nothing => return Ok(Next::Nothing),
        BatchReadiness::StepMoved => return Ok(Next::Moved),
        BatchReadiness::TooOldOnly { .. } if speculative => return Ok(Next::Nothing),
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
    claim(ctx, current, eligible_limit, waited).await
}

async fn claim(ctx: &StepContext<'_>, current: StepNumber, eligible_limit: i64, waited: Instant) -> Result<Next> {
    let plan = BatchPlan { eligible_limit, wait_s: waited.elapsed().as_secs_f64() };
    Ok(Next::Pass(claim_and_prepare(ctx, current, plan).await?))
}
