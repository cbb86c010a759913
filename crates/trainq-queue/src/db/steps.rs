//! Tables `trainq.steps` and `trainq.checkpoints`: the fenced commit of an optimizer step, and
//! reading steps and the latest checkpoint back.

use crate::ids::{ClaimToken, GroupId, StepNumber};
use chrono::{DateTime, Utc};
use sqlx::{PgPool, Postgres, Transaction};

use super::claims::{execute_fenced, fenced, skip_with};
use crate::error::{Error, Result};
use crate::rl::SkippedGroup;

/// One optimizer step as recorded in `trainq.steps` (DESIGN §2).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct StepRecord {
    /// Model trained.
    pub model: String,
    /// The new step number (the model's current step + 1).
    pub step: StepNumber,
    /// Worker that ran it.
    pub worker_id: String,
    /// Whether groups sampled from older checkpoints were accepted.
    pub async_weight_syncing: bool,
    /// When the step began (claim).
    pub started_at: DateTime<Utc>,
    /// When the step finished (before commit).
    pub finished_at: DateTime<Utc>,
    /// Groups claimed for the step.
    pub groups_claimed: i32,
    /// `groups_per_step` when the step was taken: fewer eligible groups than this is a short
    /// batch (`max_batch_wait_seconds` ran out).
    pub groups_wanted: Option<i32>,
    /// Groups trained.
    pub groups_trained: i32,
    /// Skipped groups by reason, e.g. `{"zero_variance": 3}`.
    pub groups_skipped: serde_json::Value,
    /// Trajectories trained.
    pub trajectories: i32,
    /// Tokens trained (assistant tokens).
    pub tokens: i64,
    /// Policy loss.
    pub loss: Option<f64>,
    /// Loss parts and other metrics, e.g. `{"pg": …, "kl": …, "clip_fraction": …}`.
    pub loss_parts: serde_json::Value,
    /// Gradient norm before clipping.
    pub grad_norm: Option<f64>,
    /// Learning rate used.
    pub learning_rate: Option<f64>,
    /// Mean reward over trained trajectories.
    pub reward_mean: Option<f64>,
    /// Mean reward over the trajectories of every claimed group, trained or skipped.
    pub reward_mean_claimed: Option<f64>,
    /// Mean reward over the trajectories of the skipped groups (`None`: none skipped).
    pub reward_mean_skipped: Option<f64>,
    /// Share of trained tokens that carried a sampler log-prob.
    pub logprob_coverage: Option<f64>,
    /// Mean importance ratio over trained tokens (1 where no sampler log-prob).
    pub importance_ratio_mean: Option<f64>,
    /// Mean over trained groups of each group's own reward std.
    pub reward_std_mean: Option<f64>,
    /// Smallest `current_step − policy_version` among trained groups, `current_step` being the
    /// checkpoint this step started from (`step − 1`): on-policy groups have lag 0.
    pub policy_lag_min: Option<i64>,
    /// Largest `current_step − policy_version` among trained groups.
    pub policy_lag_max: Option<i64>,
    /// Seconds per phase, e.g. `{"train": 12.3}`.
    pub timings: serde_json::Value,
    /// Devices used, e.g. `["cuda:0"]`.
    pub devices: serde_json::Value,
    /// Checkpoint directory URI.
    pub checkpoint_uri: Option<String>,
    /// sha256 of the checkpoint's manifest.json.
    pub checkpoint_sha256: Option<String>,
}

/// An uploaded checkpoint (`trainq.checkpoints`).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct CheckpointRecord {
    /// Model.
    pub model: String,
    /// Step the weights belong to.
    pub step: StepNumber,
    /// Checkpoint directory URI, e.g. `s3://bucket/prefix/m1/checkpoints/7/`.
    pub uri: String,
    /// `peft_lora` or `hf_full`.
    pub format: String,
    /// Total bytes of the checkpoint files.
    pub bytes: i64,
    /// sha256 (lowercase hex) of manifest.json.
    pub sha256: String,
    /// The manifest (files, sizes, sha256).
    pub manifest: serde_json::Value,
}

/// Records a step in ONE transaction, fenced on `token`: marks `trained_ids` trained at
/// `step.step` and `skipped` skipped, inserts the step (and checkpoint) row, advances
/// `models.current_step`, and sends `NOTIFY trainq_checkpoints` with `{model, step}` — a hint
/// only (any role may notify any channel): readers take the URI and sha256 from
/// `trainq.latest_checkpoint()`, never from a payload.
/// [`Error::LostClaim`] and nothing written if any group is no longer held by `token`.
pub async fn commit_step(
    pool: &PgPool,
    step: &StepRecord,
    checkpoint: Option<&CheckpointRecord>,
    token: ClaimToken,
    trained_ids: &[GroupId],
    skipped: &[SkippedGroup],
) -> Result<()> {
    let what = format!("commit step {} of model {:?}", step.step, step.model);
    let mut tx = pool.begin().await.map_err(Error::db(what.clone()))?;
    mark_trained(&mut tx, pool, token, trained_ids, step.step).await?;
    skip_with(&mut *tx, pool, token, skipped).await?;
    insert_step(&mut tx, step).await.map_err(Error::db(what.clone()))?;
    if let Some(c) = checkpoint {
        insert_checkpoint(&mut tx, c).await.map_err(Error::db(format!("{what}: checkpoint")))?;
    }
    sqlx::query(
        "WITH advanced AS ( \
             UPDATE trainq.models SET current_step = greatest(current_step, $2) WHERE name = $1 RETURNING name) \
         SELECT pg_notify('trainq_checkpoints', json_build_object('model', $1::text, 'step', $2::bigint)::text) \
         FROM advanced",
    )
    .bind(&step.model)
    .bind(step.step)
    .execute(&mut *tx)
    .await
    .map_err(Error::db(format!("{what}: advance current_step")))?;
    tx.commit().await.map_err(Error::db(what))
}

async fn mark_trained(
    tx: &mut Transaction<'_, Postgres>,
    pool: &PgPool,
    token: ClaimToken,
    ids: &[GroupId],
    step: StepNumber,
) -> Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    let sql = fenced(
        "UPDATE trainq.groups SET state = 'trained', step = $3, finished_at = now() \
         WHERE id = ANY($2) AND claim_token = $1 AND state = 'claimed'",
        "$4::bigint",
    );
    let query = sqlx::query(&sql).bind(token).bind(ids).bind(step).bind(ids.len() as i64);
    execute_fenced(query, &mut **tx, pool, ids, format!("mark {} group(s) trained at step {step}", ids.len())).await
}

async fn insert_step(tx: &mut Transaction<'_, Postgres>, s: &StepRecord) -> std::result::Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO trainq.steps (model, step, worker_id, async_weight_syncing, started_at, finished_at, \
             groups_claimed, groups_trained, groups_skipped, trajectories, tokens, loss, loss_parts, grad_norm, \
             learning_rate, reward_mean, reward_std_mean, policy_lag_min, policy_lag_max, timings, devices, \
             checkpoint_uri, checkpoint_sha256, groups_wanted, reward_mean_claimed, reward_mean_skipped, \
             logprob_coverage, importance_ratio_mean) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, \
                 $24, $25, $26, $27, $28)",
    )
    .bind(&s.model)
    .bind(s.step)
    .bind(&s.worker_id)
    .bind(s.async_weight_syncing)
    .bind(s.started_at)
    .bind(s.finished_at)
    .bind(s.groups_claimed)
    .bind(s.groups_trained)
    .bind(&s.groups_skipped)
    .bind(s.trajectories)
    .bind(s.tokens)
    .bind(s.loss)
    .bind(&s.loss_parts)
    .bind(s.grad_norm)
    .bind(s.learning_rate)
    .bind(s.reward_mean)
    .bind(s.reward_std_mean)
    .bind(s.policy_lag_min)
    .bind(s.policy_lag_max)
    .bind(&s.timings)
    .bind(&s.devices)
    .bind(&s.checkpoint_uri)
    .bind(&s.checkpoint_sha256)
    .bind(s.groups_wanted)
    .bind(s.reward_mean_claimed)
    .bind(s.reward_mean_skipped)
    .bind(s.logprob_coverage)
    .bind(s.importance_ratio_mean)
    .execute(&mut **tx)
    .await
    .map(drop)
}

async fn insert_checkpoint(
    tx: &mut Transaction<'_, Postgres>,
    c: &CheckpointRecord,
) -> std::result::Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO trainq.checkpoints (model, step, uri, format, bytes, sha256, manifest) \
         VALUES ($1, $2, $3, $4::trainq.checkpoint_format, $5, $6, $7)",
    )
    .bind(&c.model)
    .bind(c.step)
    .bind(&c.uri)
    .bind(&c.format)
    .bind(c.bytes)
    .bind(&c.sha256)
    .bind(&c.manifest)
    .execute(&mut **tx)
    .await
    .map(drop)
}

/// The steps of a model, newest first, at most `limit`.
pub async fn list_steps(pool: &PgPool, model: &str, limit: i64) -> Result<Vec<StepRecord>> {
    sqlx::query_as("SELECT * FROM trainq.steps WHERE model = $1 ORDER BY step DESC LIMIT $2")
        .bind(model)
        .bind(limit)
        .fetch_all(pool)
        .await
        .map_err(Error::db(format!("list steps of model {model:?}")))
}

/// Every step of a model, oldest first (for reports; a row is a few hundred bytes, so even
/// 100,000 steps are a few tens of MB).
pub async fn all_steps(pool: &PgPool, model: &str) -> Result<Vec<StepRecord>> {
    sqlx::query_as("SELECT * FROM trainq.steps WHERE model = $1 ORDER BY step")
        .bind(model)
        .fetch_all(pool)
        .await
        .map_err(Error::db(format!("all steps of model {model:?}")))
}

/// The newest checkpoint of a model (via `trainq.latest_checkpoint`), `None` before the first.
pub async fn latest_checkpoint(pool: &PgPool, model: &str) -> Result<Option<CheckpointRecord>> {
    sqlx::query_as(
        "SELECT c.model, c.step, c.uri, c.format::text AS format, c.bytes, c.sha256, c.manifest \
         FROM trainq.latest_checkpoint($1) l JOIN trainq.checkpoints c ON c.model = $1 AND c.step = l.step",
    )
    .bind(model)
    .fetch_optional(pool)
    .await
    .map_err(Error::db(format!("latest checkpoint of model {model:?}")))
}

/// Marks the checkpoints of `model` at `steps` deleted (`deleted_at = now()`) after retention
/// removed their objects; rows already marked keep their first time. Returns the rows marked now.
pub async fn mark_checkpoints_deleted(pool: &PgPool, model: &str, steps: &[StepNumber]) -> Result<u64> {
    sqlx::query(
        "UPDATE trainq.checkpoints SET deleted_at = now() \
         WHERE model = $1 AND step = ANY($2) AND deleted_at IS NULL",
    )
    .bind(model)
    .bind(steps)
    .execute(pool)
    .await
    .map(|done| done.rows_affected())
    .map_err(Error::db(format!("mark checkpoints {steps:?} of model {model:?} deleted")))
}

/// Steps of `model` whose checkpoint rows are marked deleted, ascending.
pub async fn deleted_checkpoint_steps(pool: &PgPool, model: &str) -> Result<Vec<StepNumber>> {
    sqlx::query_scalar("SELECT step FROM trainq.checkpoints WHERE model = $1 AND deleted_at IS NOT NULL ORDER BY step")
        .bind(model)
        .fetch_all(pool)
        .await
        .map_err(Error::db(format!("deleted checkpoints of model {model:?}")))
}

/// The checkpoint row of `model` at `step`, if one was committed.
pub async fn checkpoint_at(pool: &PgPool, model: &str, step: StepNumber) -> Result<Option<CheckpointRecord>> {
    sqlx::query_as(
        "SELECT model, step, uri, format::text AS format, bytes, sha256, manifest \
         FROM trainq.checkpoints WHERE model = $1 AND step = $2",
    )
    .bind(model)
    .bind(step)
    .fetch_optional(pool)
    .await
    .map_err(Error::db(format!("checkpoint {step} of model {model:?}")))
}
