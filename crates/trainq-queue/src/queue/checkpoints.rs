//! Following a model's checkpoints from an inference host: the latest committed one (read from
//! `trainq.latest_checkpoint()`, which a producer cannot write), and waiting for a newer one
//! with `LISTEN trainq_checkpoints` plus a poll fallback. Any role may notify any channel, so
//! the notification (payload `{"model", "step"}`) only wakes the waiter; what it returns, URI
//! and sha256 included, always comes from the table.

use std::time::Duration;

use sqlx::PgPool;
use tokio::time::Instant;

use super::listener::Listener;
use crate::db::steps::latest_checkpoint;
use crate::error::{Error, Result};
use crate::ids::StepNumber;
use crate::storage::store_url_of;

/// The channel a commit notifies (payload `{"model", "step"}`, a hint only).
pub const CHECKPOINTS_CHANNEL: &str = "trainq_checkpoints";
/// How often a waiter re-reads the table when no notification comes.
pub const CHECKPOINT_POLL_INTERVAL: Duration = Duration::from_secs(5);

/// A committed checkpoint and where to fetch it from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LatestCheckpoint {
    /// The model.
    pub model: String,
    /// Its step.
    pub step: StepNumber,
    /// `{store}/{model}/checkpoints/{step:06}/`.
    pub uri: String,
    /// sha256 of the checkpoint's `manifest.json`.
    pub sha256: String,
    /// The store's root URL, for [`crate::storage::Store::open_with`].
    pub store_url: String,
}

/// The model's latest committed checkpoint whose files are still in the store, if any.
pub async fn latest(pool: &PgPool, model: &str) -> Result<Option<LatestCheckpoint>> {
    let Some(record) = latest_checkpoint(pool, model).await? else {
        return Ok(None);
    };
    let step = record.step;
    let store_url = store_url_of(&record.uri, model, step)?;
    Ok(Some(LatestCheckpoint { model: model.to_string(), step, uri: record.uri, sha256: record.sha256, store_url }))
}

/// Waits until `model` has a committed checkpoint newer than `after` and returns it; fails with
/// [`Error::NotFound`] when none comes within `timeout`. Pass [`StepNumber::BASE`] to take any.
pub async fn wait_for_checkpoint(
    pool: &PgPool,
    model: &str,
    after: StepNumber,
    timeout: Duration,
) -> Result<LatestCheckpoint> {
    let deadline = Instant::now() + timeout;
    let mut listener = Listener::connect_or_retry(pool, CHECKPOINTS_CHANNEL).await;
    loop {
        if let Some(found) = latest(pool, model).await? {
            if found.step > after {
                return Ok(found);
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::NotFound {
                what: format!("a checkpoint of model {model:?} newer than step {after} within {timeout:?}"),
            });
        }
        let until = now + (deadline - now).min(CHECKPOINT_POLL_INTERVAL);
        // Any wake-up (a notification of any model, a re-established connection) is only a
        // hint to re-read the table.
        listener.wake_before(until).await;
    }
}
