//! Waiting for pending groups: `LISTEN trainq_groups` (payload: model), with a poll fallback
//! (and the LISTEN connection re-established with backoff when it is lost, see [`super::listener`]);
//! and assembling a batch (DESIGN §5b): waiting until a step's worth of eligible groups is
//! pending, or until the oldest of them has waited `max_batch_wait`.

use std::time::Duration;

use sqlx::PgPool;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::listener::{Listener, Wake};
use crate::db::claims::PolicyWindow;
use crate::db::groups::{count_claimable, has_pending};
use crate::error::Result;

/// The channel `INSERT INTO trainq.groups` notifies, with the model name as payload.
pub const GROUPS_CHANNEL: &str = "trainq_groups";
/// How often a waiter re-checks the table when no notification comes. Short, because a producer
/// skips its NOTIFY while another transaction of the same model is notifying (see migration 0005),
/// and the check is one index probe.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(1);

/// What [`GroupWaiter::wait_for_batch`] found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BatchReadiness {
    /// At least the wanted number of eligible groups is pending.
    Full {
        /// Eligible groups pending.
        eligible: i64,
    },
    /// Fewer are pending, but the oldest has waited `max_batch_wait`: train what there is.
    Short {
        /// Eligible groups pending.
        eligible: i64,
        /// Seconds the oldest of them has waited.
        waited_seconds: f64,
    },
    /// No eligible group, but some too old for any future step: claim them to skip them `stale`.
    TooOldOnly {
        /// Too-old groups pending.
        too_old: i64,
    },
    /// The model's current step has moved past the window's (another worker committed).
    StepMoved,
    /// Nothing eligible or too old arrived within the timeout.
    Nothing,
}

/// Waits for pending groups of a model; reuse it across steps to keep one LISTEN connection.
#[derive(Debug)]
pub struct GroupWaiter {
    pool: PgPool,
    listener: Option<Listener>,
    poll_interval: Duration,
}

impl GroupWaiter {
    /// A waiter that LISTENs on [`GROUPS_CHANNEL`] and also polls every `poll_interval`. A
    /// LISTEN connection lost later is opened again with backoff (polling meanwhile).
    pub async fn listen(pool: &PgPool, poll_interval: Duration) -> Result<Self> {
        let listener = Listener::connect(pool, GROUPS_CHANNEL).await?;
        Ok(Self { pool: pool.clone(), listener: Some(listener), poll_interval })
    }

    /// Whether the LISTEN connection is open now (false for [`GroupWaiter::poll_only`] and while
    /// a lost connection is being re-established).
    pub fn is_listening(&self) -> bool {
        self.listener.as_ref().is_some_and(Listener::is_connected)
    }

    /// A waiter that only polls (no LISTEN connection), e.g. behind a pooler that drops NOTIFY.
    pub fn poll_only(pool: &PgPool, poll_interval: Duration) -> Self {
        Self { pool: pool.clone(), listener: None, poll_interval }
    }

    /// Returns true as soon as `model` has a pending group, false after `timeout` without one.
    pub async fn wait(&mut self, model: &str, timeout: Duration) -> Result<bool> {
        let deadline = Instant::now() + timeout;
        loop {
            if has_pending(&self.pool, model).await? {
                return Ok(true);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            let nap = (deadline - now).min(self.poll_interval);
            self.next_wake(model, nap).await;
        }
    }

    /// Waits until a step in `window` has a batch: `want` eligible groups pending ([`BatchReadiness::Full`]),
    /// or at least one whose submission is `max_batch_wait` old ([`BatchReadiness::Short`]). While
    /// eligible groups are pending it waits for them regardless of `timeout` (at most
    /// `max_batch_wait`); with none, it returns [`BatchReadiness::TooOldOnly`] as soon as groups too old
    /// for any step are pending, and [`BatchReadiness::Nothing`] after `timeout`. Woken by
    /// `NOTIFY trainq_groups`, re-counting every poll interval at the latest.
    pub async fn wait_for_batch(
        &mut self,
        model: &str,
        window: &PolicyWindow,
        want: i64,
        max_batch_wait: Duration,
        timeout: Duration,
    ) -> Result<BatchReadiness> {
        let deadline = Instant::now() + timeout;
        loop {
            let found = count_claimable(&self.pool, model, window).await?;
            // Behind the window is this worker's own step still being committed (async weight
            // syncing overlaps a commit with the next step); ahead is another worker's commit.
            if found.current_step > window.current_step {
                return Ok(BatchReadiness::StepMoved);
            }
            if found.eligible >= want {
                return Ok(BatchReadiness::Full { eligible: found.eligible });
            }
            if found.eligible > 0 {
                let waited = Duration::from_secs_f64(found.oldest_eligible_age_seconds.unwrap_or(0.0).max(0.0));
                if waited >= max_batch_wait {
                    let waited_seconds = waited.as_secs_f64();
                    return Ok(BatchReadiness::Short { eligible: found.eligible, waited_seconds });
                }
                let nap = (max_batch_wait - waited).min(self.poll_interval);
                self.next_wake(model, nap).await;
                continue;
            }
            if found.too_old > 0 {
                return Ok(BatchReadiness::TooOldOnly { too_old: found.too_old });
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(BatchReadiness::Nothing);
            }
            self.next_wake(model, (deadline - now).min(self.poll_interval)).await;
        }
    }

    /// Waits, woken by `NOTIFY trainq_groups`, until `want` eligible groups of a step in
    /// `window` are pending ([`BatchReadiness::Full`]) or another worker's commit moved the model
    /// past the window ([`BatchReadiness::StepMoved`]); `None` once `stop` fires. Short and
    /// too-old batches are left to [`GroupWaiter::wait_for_batch`]: this is the wait of a worker
    /// that claims the next batch while the current step trains, and takes only a full one.
    pub async fn wait_for_full_batch(
        &mut self,
        model: &str,
        window: &PolicyWindow,
        want: i64,
        stop: &CancellationToken,
    ) -> Result<Option<BatchReadiness>> {
        loop {
            let found = count_claimable(&self.pool, model, window).await?;
            if found.current_step > window.current_step {
                return Ok(Some(BatchReadiness::StepMoved));
            }
            if found.eligible >= want {
                return Ok(Some(BatchReadiness::Full { eligible: found.eligible }));
            }
            let nap = self.poll_interval;
            tokio::select! {
                _ = stop.cancelled() => return Ok(None),
                _ = self.next_wake(model, nap) => {}
            }
        }
    }

    /// Sleeps up to `nap`, or until a notification for `model` arrives (or the lost LISTEN
    /// connection is back: what was sent meanwhile is lost, so the caller looks again).
    async fn next_wake(&mut self, model: &str, nap: Duration) {
        let Some(listener) = self.listener.as_mut() else {
            tokio::time::sleep(nap).await;
            return;
        };
        let until = Instant::now() + nap;
        loop {
            match listener.wake_before(until).await {
                Wake::Notified(payload) if payload != model => continue,
                Wake::Notified(_) | Wake::Reconnected | Wake::TimedOut => return,
            }
        }
    }
}

/// Waits up to `timeout` for a pending group of `model` (LISTEN plus polling every
/// [`DEFAULT_POLL_INTERVAL`]); true when one is there. Opens a listener per call: keep a
/// [`GroupWaiter`] instead when waiting repeatedly.
pub async fn wait_for_groups(pool: &PgPool, model: &str, timeout: Duration) -> Result<bool> {
    GroupWaiter::listen(pool, DEFAULT_POLL_INTERVAL).await?.wait(model, timeout).await
}
