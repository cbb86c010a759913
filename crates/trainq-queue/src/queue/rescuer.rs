//! The rescuer: periodically returns groups whose lease expired to pending (or failed).

use std::time::Duration;

use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::db::claims::rescue_expired;

/// Runs [`rescue_expired`] every `every` until `cancel` fires; logs what each pass did. Any worker
/// (or a dedicated process) may run one; passes are safe to overlap (`SKIP LOCKED`).
pub fn spawn_rescuer(pool: PgPool, every: Duration, cancel: CancellationToken) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            match rescue_expired(&pool, None).await {
                Ok(r) if r.returned + r.failed > 0 => {
                    tracing::info!(returned = r.returned, failed = r.failed, "rescued expired claims")
                }
                Ok(_) => {}
                Err(err) => tracing::warn!("rescuer pass failed: {err}"),
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
        }
    })
}
