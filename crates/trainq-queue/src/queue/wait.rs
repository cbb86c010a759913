//! Waiting for pending groups: `LISTEN trainq_groups` (payload: model), with a poll fallback.

use std::time::Duration;

use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio::time::Instant;

use crate::db::groups::has_pending;
use crate::error::{Error, Result};

/// The channel `INSERT INTO trainq.groups` notifies, with the model name as payload.
pub const GROUPS_CHANNEL: &str = "trainq_groups";
/// How often a waiter re-checks the table when no notification comes. Short, because a producer
/// skips its NOTIFY while another transaction of the same model is notifying (see migration 0005),
/// and the check is one index probe.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(1);

/// Waits for pending groups of a model; reuse it across steps to keep one LISTEN connection.
#[derive(Debug)]
pub struct GroupWaiter {
    pool: PgPool,
    listener: Option<PgListener>,
    poll_interval: Duration,
}

impl GroupWaiter {
    /// A waiter that LISTENs on [`GROUPS_CHANNEL`] and also polls every `poll_interval`.
    pub async fn listen(pool: &PgPool, poll_interval: Duration) -> Result<Self> {
        let mut listener = PgListener::connect_with(pool).await.map_err(Error::db("connect listener"))?;
        listener.listen(GROUPS_CHANNEL).await.map_err(Error::db("LISTEN trainq_groups"))?;
        Ok(Self { pool: pool.clone(), listener: Some(listener), poll_interval })
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

    /// Sleeps up to `nap`, or until a notification for `model` arrives.
    async fn next_wake(&mut self, model: &str, nap: Duration) {
        let Some(listener) = self.listener.as_mut() else {
            tokio::time::sleep(nap).await;
            return;
        };
        let until = Instant::now() + nap;
        loop {
            match tokio::time::timeout_at(until, listener.recv()).await {
                Err(_elapsed) => return,
                Ok(Ok(note)) if note.payload() == model => return,
                Ok(Ok(_other_model)) => continue,
                Ok(Err(err)) => {
                    tracing::warn!("LISTEN {GROUPS_CHANNEL} failed, falling back to polling: {err}");
                    self.listener = None;
                    tokio::time::sleep_until(until).await;
                    return;
                }
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
