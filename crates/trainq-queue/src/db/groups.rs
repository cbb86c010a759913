//! Table `trainq.groups`, producer side: submitting groups and counting the queue.
//!
//! The worker side of the same table (claim, lease, skip, fail, rescue) is in [`super::claims`].

use std::collections::BTreeMap;

use crate::ids::{GroupId, StepNumber};
use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::error::{Error, Result};

/// One group as a producer submits it (the four producer-written columns).
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct NewGroup {
    /// Model name.
    pub model: String,
    /// JSON array of trajectories.
    pub trajectories: serde_json::Value,
    /// Checkpoint step the rollouts were sampled from.
    #[serde(default)]
    pub policy_version: Option<StepNumber>,
    /// Any JSON object.
    #[serde(default = "empty_object")]
    pub metadata: serde_json::Value,
}

fn empty_object() -> serde_json::Value {
    serde_json::json!({})
}

/// Submits one group through `trainq.submit_group` and returns its id. Bad input fails with the
/// database's `TQ…` SQLSTATE and message (see `db::sqlstate`).
pub async fn submit_group(pool: &PgPool, group: &NewGroup) -> Result<GroupId> {
    submit_on(pool, group).await.map_err(Error::db(format!("submit group to model {:?}", group.model)))
}

/// `trainq.submit_group` for one group on any executor (a pool or an open transaction).
async fn submit_on<'e>(executor: impl sqlx::PgExecutor<'e>, group: &NewGroup) -> sqlx::Result<GroupId> {
    sqlx::query_scalar("SELECT trainq.submit_group($1, $2, $3, $4)")
        .bind(&group.model)
        .bind(&group.trajectories)
        .bind(group.policy_version)
        .bind(&group.metadata)
        .fetch_one(executor)
        .await
}

/// Submits several groups in one transaction: all become visible to workers at once (or none
/// on error). Returns their ids in order.
pub async fn submit_groups(pool: &PgPool, groups: &[NewGroup]) -> Result<Vec<GroupId>> {
    let mut tx = pool.begin().await.map_err(Error::db("begin submit"))?;
    let mut ids = Vec::with_capacity(groups.len());
    for group in groups {
        let id = submit_on(&mut *tx, group).await.map_err(Error::db(format!(
            "submit group {} to model {:?}",
            ids.len(),
            group.model
        )))?;
        ids.push(id);
    }
    tx.commit().await.map_err(Error::db("commit submit"))?;
    Ok(ids)
}

/// Number of pending groups of `model`.
pub async fn count_pending(pool: &PgPool, model: &str) -> Result<i64> {
    sqlx::query_scalar("SELECT count(*) FROM trainq.groups WHERE model = $1 AND state = 'pending'")
        .bind(model)
        .fetch_one(pool)
        .await
        .map_err(Error::db(format!("count pending groups of model {model:?}")))
}

/// Whether `model` has at least one pending group that may be claimed now (its retry backoff,
/// if any, is over).
pub async fn has_pending(pool: &PgPool, model: &str) -> Result<bool> {
    let ready = super::claims::ready_sql("now()");
    sqlx::query_scalar(&format!(
        "SELECT EXISTS (SELECT 1 FROM trainq.groups WHERE model = $1 AND state = 'pending' AND {ready})"
    ))
    .bind(model)
    .fetch_one(pool)
    .await
    .map_err(Error::db(format!("check pending groups of model {model:?}")))
}

/// What a step from one checkpoint could claim now (see [`super::claims::PolicyWindow`]).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ClaimableGroups {
    /// The model's current step when counted (the window is only right if it equals the one asked).
    pub current_step: StepNumber,
    /// Pending groups this step may train.
    pub eligible: i64,
    /// Seconds since the oldest eligible pending group was submitted (database clock).
    pub oldest_eligible_age_seconds: Option<f64>,
    /// Pending groups too old for this or any later step (to be skipped `stale`).
    pub too_old: i64,
}

/// Counts the pending groups of `model` that a step in `window` may train, and those too old
/// for it, in one index scan of the pending groups; groups still in their retry backoff are
/// left out.
pub async fn count_claimable(
    pool: &PgPool,
    model: &str,
    window: &super::claims::PolicyWindow,
) -> Result<ClaimableGroups> {
    let eligible = super::claims::eligible_sql("$2", "$3", "$4");
    let ready = super::claims::ready_sql("now()");
    let sql = format!(
        "SELECT m.current_step, \
                count(g.id) FILTER (WHERE {eligible}), \
                extract(epoch FROM now() - min(g.created_at) FILTER (WHERE {eligible}))::float8, \
                count(g.id) FILTER (WHERE NOT {eligible}) \
         FROM trainq.models m LEFT JOIN trainq.groups g ON g.model = m.name AND g.state = 'pending' AND {ready} \
         WHERE m.name = $1 GROUP BY m.current_step"
    );
    let row: Option<(StepNumber, i64, Option<f64>, i64)> = sqlx::query_as(&sql)
        .bind(model)
        .bind(window.current_step)
        .bind(window.accepted_staleness)
        .bind(window.unknown_policy_version.as_str())
        .fetch_optional(pool)
        .await
        .map_err(Error::db(format!("count claimable groups of model {model:?}")))?;
    let (current_step, eligible, oldest_eligible_age_seconds, too_old) =
        row.ok_or_else(|| Error::UnknownModel(model.to_string()))?;
    Ok(ClaimableGroups { current_step, eligible, oldest_eligible_age_seconds, too_old })
}

/// Queue depth of one model, as `trainq status` shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueCounts {
    /// Model name.
    pub model: String,
    /// The model's current step.
    pub current_step: StepNumber,
    /// Groups waiting to be claimed.
    pub pending: i64,
    /// Groups held by a worker.
    pub claimed: i64,
    /// Groups trained.
    pub trained: i64,
    /// Groups skipped, by reason (`zero_variance`, `stale`, …).
    pub skipped: BTreeMap<String, i64>,
    /// Groups failed.
    pub failed: i64,
    /// Age of the oldest pending group.
    pub oldest_pending_seconds: Option<f64>,
}

type CountsRow = (String, i64, i64, i64, i64, i64, Option<serde_json::Value>, Option<f64>);

/// Queue depth per model (all models, or only `model`).
pub async fn queue_counts(pool: &PgPool, model: Option<&str>) -> Result<Vec<QueueCounts>> {
    let rows: Vec<CountsRow> = sqlx::query_as(
        "SELECT m.name, m.current_step, \
                count(g.id) FILTER (WHERE g.state = 'pending'), \
                count(g.id) FILTER (WHERE g.state = 'claimed'), \
                count(g.id) FILTER (WHERE g.state = 'trained'), \
                count(g.id) FILTER (WHERE g.state = 'failed'), \
                (SELECT jsonb_object_agg(s.reason, s.n) FROM ( \
                    SELECT skip_reason::text AS reason, count(*) AS n FROM trainq.groups \
                    WHERE model = m.name AND state = 'skipped' GROUP BY 1) s), \
                extract(epoch FROM now() - min(g.created_at) FILTER (WHERE g.state = 'pending'))::float8 \
         FROM trainq.models m LEFT JOIN trainq.groups g ON g.model = m.name \
         WHERE $1::text IS NULL OR m.name = $1 \
         GROUP BY m.name, m.current_step ORDER BY m.name",
    )
    .bind(model)
    .fetch_all(pool)
    .await
    .map_err(Error::db("count groups by state"))?;
    if let (Some(name), true) = (model, rows.is_empty()) {
        return Err(Error::UnknownModel(name.to_string()));
    }
    Ok(rows.into_iter().map(counts_from_row).collect())
}

fn counts_from_row(row: CountsRow) -> QueueCounts {
    let (model, current_step, pending, claimed, trained, failed, skipped, oldest_pending_seconds) = row;
    let skipped = skipped.and_then(|v| serde_json::from_value::<BTreeMap<String, i64>>(v).ok()).unwrap_or_default();
    QueueCounts {
        model,
        current_step: StepNumber(current_step),
        pending,
        claimed,
        trained,
        skipped,
        failed,
        oldest_pending_seconds,
    }
}

/// The state of one group, as `trainq.group_status` reports it.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct GroupStatus {
    /// Model name.
    pub model: String,
    /// `pending`, `claimed`, `trained`, `skipped` or `failed`.
    pub state: String,
    /// Skip reason when skipped.
    pub skip_reason: Option<String>,
    /// The step that trained it.
    pub step: Option<StepNumber>,
    /// Claims that ended without a result.
    pub attempts: i32,
    /// Error text when failed (or of the last failed attempt).
    pub error: Option<String>,
    /// Population std of its rewards.
    pub reward_std: Option<f64>,
    /// Submission time.
    pub created_at: DateTime<Utc>,
}

/// The state of group `id` (`None` when it does not exist or is not visible to this role).
pub async fn group_status(pool: &PgPool, id: GroupId) -> Result<Option<GroupStatus>> {
    sqlx::query_as(
        "SELECT model, state::text AS state, skip_reason::text AS skip_reason, step, attempts, error, \
                reward_std, created_at FROM trainq.group_status($1)",
    )
    .bind(id)
    .fetch_optional(pool)
    .await
    .map_err(Error::db(format!("status of group {id}")))
}
