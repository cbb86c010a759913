//! The lease heartbeat: a tokio task that keeps a claim alive until it is stopped or lost.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::db::claims::extend_lease;
use crate::error::{Error, Result};
use crate::ids::ClaimToken;

/// A running heartbeat for one claim.
#[derive(Debug)]
pub struct LeaseHeartbeat {
    cancel: CancellationToken,
    lost: Arc<AtomicBool>,
    handle: JoinHandle<Result<()>>,
}

/// Starts a task that extends the lease of `token` to `lease_seconds` every `every` (pick well
/// under the lease). It ends with [`Error::LostClaim`] when no group is held by the token any
/// more, and then cancels `on_lost` so that the work done under the claim (training, upload)
/// stops at once; other database errors are logged and retried on the next tick.
pub fn spawn_lease_heartbeat(
    pool: PgPool,
    token: ClaimToken,
    lease_seconds: f64,
    every: Duration,
    on_lost: CancellationToken,
) -> LeaseHeartbeat {
    let cancel = CancellationToken::new();
    let lost = Arc::new(AtomicBool::new(false));
    let (task_cancel, task_lost) = (cancel.clone(), lost.clone());
    let handle = tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = task_cancel.cancelled() => return Ok(()),
                _ = tokio::time::sleep(every) => {}
            }
            match extend_lease(&pool, token, lease_seconds).await {
                Ok(_) => {}
                Err(err @ Error::LostClaim { .. }) => {
                    task_lost.store(true, Ordering::SeqCst);
                    on_lost.cancel();
                    tracing::warn!(%token, "lease heartbeat stopped: {err}");
                    return Err(err);
                }
                Err(err) => tracing::warn!(%token, "lease heartbeat failed, retrying: {err}"),
            }
        }
    });
    LeaseHeartbeat { cancel, lost, handle }
}

impl LeaseHeartbeat {
    /// Whether the claim was found lost (the worker should abandon the step).
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// Stops the heartbeat and returns how it ended (`Err(LostClaim)` if the claim was lost).
    pub async fn stop(mut self) -> Result<()> {
        self.cancel.cancel();
        match (&mut self.handle).await {
            Ok(result) => result,
            Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
            Err(_cancelled) => Ok(()),
        }
    }
}

/// A heartbeat dropped without [`LeaseHeartbeat::stop`] (its step given up on an error path)
/// stops extending the lease, so the rescuer can hand the groups back when it runs out.
impl Drop for LeaseHeartbeat {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
