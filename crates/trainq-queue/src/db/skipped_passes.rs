//! Table `trainq.skipped_passes`: a claim whose groups were all skipped, so no step was taken —
//! recorded with the groups' skips in one transaction, fenced on the claim token, so that
//! saturation (every group zero-variance) stays visible next to the steps.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use super::claims::skip_with;
use crate::error::{Error, Result};
use crate::ids::{ClaimToken, StepNumber};
use crate::rl::SkippedGroup;

/// One pass that claimed groups and skipped them all.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct SkippedPass {
    /// Model.
    pub model: String,
    /// The model's current step at the claim (the step not taken is this + 1).
    pub current_step: StepNumber,
    /// Worker that claimed the groups.
    pub worker_id: String,
    /// When the claim was made.
    pub started_at: DateTime<Utc>,
    /// Groups claimed (all skipped).
    pub groups_claimed: i32,
    /// Skipped groups by reason, e.g. `{"zero_variance": 8}`.
    pub groups_skipped: serde_json::Value,
    /// Mean reward over the trajectories of the claimed groups.
    pub reward_mean_claimed: Option<f64>,
    /// Mean over the claimed groups of each group's own reward std.
    pub reward_std_mean: Option<f64>,
}

/// Marks `skipped` skipped (fenced on `token`) and inserts the pass row, in one transaction.
pub async fn record_skipped_pass(
    pool: &PgPool,
    token: ClaimToken,
    pass: &SkippedPass,
    skipped: &[SkippedGroup],
) -> Result<()> {
    let what = format!("record a skipped pass of model {:?} at step {}", pass.model, pass.current_step);
    let mut tx = pool.begin().await.map_err(Error::db(what.clone()))?;
    skip_with(&mut *tx, pool, token, skipped).await?;
    sqlx::query(
        "INSERT INTO trainq.skipped_passes (model, current_step, worker_id, started_at, groups_claimed, \
             groups_skipped, reward_mean_claimed, reward_std_mean) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(&pass.model)
    .bind(pass.current_step)
    .bind(&pass.worker_id)
    .bind(pass.started_at)
    .bind(pass.groups_claimed)
    .bind(&pass.groups_skipped)
    .bind(pass.reward_mean_claimed)
    .bind(pass.reward_std_mean)
    .execute(&mut *tx)
    .await
    .map_err(Error::db(what.clone()))?;
    tx.commit().await.map_err(Error::db(what))
}

/// The skipped passes of a model, newest first, at most `limit`.
pub async fn list_skipped_passes(pool: &PgPool, model: &str, limit: i64) -> Result<Vec<SkippedPass>> {
    sqlx::query_as(
        "SELECT model, current_step, worker_id, started_at, groups_claimed, groups_skipped, reward_mean_claimed, \
                reward_std_mean FROM trainq.skipped_passes WHERE model = $1 ORDER BY id DESC LIMIT $2",
    )
    .bind(model)
    .bind(limit)
    .fetch_all(pool)
    .await
    .map_err(Error::db(format!("list skipped passes of model {model:?}")))
}

/// How many skipped passes `model` has recorded (every worker).
pub async fn count_skipped_passes(pool: &PgPool, model: &str) -> Result<i64> {
    sqlx::query_scalar("SELECT count(*) FROM trainq.skipped_passes WHERE model = $1")
        .bind(model)
        .fetch_one(pool)
        .await
        .map_err(Error::db(format!("count skipped passes of model {model:?}")))
}
