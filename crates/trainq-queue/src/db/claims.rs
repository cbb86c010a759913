//! Table `trainq.groups`, worker side: claim a batch with a lease, extend it, and finish groups
//! (skip, fail, release) fenced on the claim token; the rescuer's query for expired leases.
//!
//! A claimed group's JSON is decoded row by row: a group the worker cannot decode (stored before
//! the database refused such input, e.g. a number beyond a double) comes back marked
//! [`ClaimedGroup::unusable`], to be skipped `invalid` on its own; it never fails the claim.

use crate::ids::{ClaimToken, GroupId, StepNumber};
use chrono::{DateTime, Utc};
use sqlx::{PgPool, Postgres};

use super::sqlstate;
use crate::config::{
    UnknownPolicyVersion, DEFAULT_MAX_ATTEMPTS, DEFAULT_RETRY_BACKOFF_SECONDS, MAX_RETRY_BACKOFF_SECONDS,
};
use crate::error::{Error, Result};
use crate::rl::{GroupRewards, SkippedGroup};

/// What to claim.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimParams {
    /// Model whose pending groups to claim.
    pub model: String,
    /// Id of the claiming worker (kept in `claimed_by`).
    pub worker_id: String,
    /// Largest number of groups to claim (with a `window`: of eligible groups).
    pub limit: i64,
    /// Lease length; the heartbeat extends it.
    pub lease_seconds: f64,
    /// Clock to use instead of the database's `now()` (tests).
    pub now: Option<DateTime<Utc>>,
    /// Which groups a step from this checkpoint may train; `None` claims any pending group.
    pub window: Option<PolicyWindow>,
}

/// Which pending groups a step starting from `current_step` may train (DESIGN §5b): eligible
/// ones have `current_step − policy_version ≤ accepted_staleness` (or an unknown version that
/// the model accepts); too-old ones can never be trained by this or any later step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyWindow {
    /// The model's current step (the checkpoint the step starts from).
    pub current_step: StepNumber,
    /// Largest accepted lag: 0 when on-policy, `max_staleness` with async weight syncing.
    pub accepted_staleness: i64,
    /// What a NULL `policy_version` is.
    pub unknown_policy_version: UnknownPolicyVersion,
    /// Largest number of too-old groups to claim along with the eligible ones (they are
    /// skipped `stale` by the step, so they are recorded with it instead of waiting forever).
    pub too_old_limit: i64,
}

/// SQL predicate (on `trainq.groups`) for an eligible group, given the placeholders of the
/// current step, the accepted staleness and the unknown-version setting.
pub(crate) fn eligible_sql(current_step: &str, accepted_staleness: &str, unknown: &str) -> String {
    format!(
        "(CASE WHEN policy_version IS NULL THEN {unknown}::text = 'accept' \
         ELSE policy_version >= {current_step}::bigint - {accepted_staleness}::bigint END)"
    )
}

/// SQL predicate (on `trainq.groups`) for a pending group whose retry backoff is over at `now`.
pub(crate) fn ready_sql(now: &str) -> String {
    format!("(retry_after IS NULL OR retry_after <= {now})")
}

/// A claimed batch: the token that fences every later write, and the groups, oldest first.
#[derive(Debug, Clone, PartialEq)]
pub struct Claim {
    /// Claim token, written to every claimed row.
    pub token: ClaimToken,
    /// Model of the groups.
    pub model: String,
    /// The groups, in id (submission) order; empty when nothing was pending.
    pub groups: Vec<ClaimedGroup>,
}

/// One claimed group, as submitted plus the statistics computed on insert.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimedGroup {
    /// Group id.
    pub id: GroupId,
    /// Checkpoint step the rollouts were sampled from.
    pub policy_version: Option<StepNumber>,
    /// The JSON array of trajectories, as submitted (`null` when the group is unusable).
    pub trajectories: serde_json::Value,
    /// Mean reward.
    pub reward_mean: f64,
    /// Population std of the rewards.
    pub reward_std: f64,
    /// Number of trajectories.
    pub reward_count: i32,
    /// Earlier claims of this group that ended without a result.
    pub attempts: i32,
    /// The producer's metadata object (`null` when the group is unusable).
    pub metadata: serde_json::Value,
    /// Why the stored group cannot be used, when its JSON did not decode: e.g.
    /// `trajectories: number out of range at line 1 column 40`.
    pub unusable: Option<String>,
}

/// A claimed row as the database returns it: the JSON columns as text, decoded per row.
#[derive(sqlx::FromRow)]
struct ClaimedRow {
    id: GroupId,
    policy_version: Option<StepNumber>,
    trajectories: String,
    reward_mean: f64,
    reward_std: f64,
    reward_count: i32,
    attempts: i32,
    metadata: String,
}

impl ClaimedRow {
    /// Decodes the JSON columns; a failure marks the group unusable instead of failing the claim.
    fn decode(self) -> ClaimedGroup {
        let decoded = serde_json::from_str(&self.trajectories)
            .map_err(|e| format!("trajectories: {e}"))
            .and_then(|t| Ok((t, serde_json::from_str(&self.metadata).map_err(|e| format!("metadata: {e}"))?)));
        let (trajectories, metadata, unusable) = match decoded {
            Ok((t, m)) => (t, m, None),
            Err(e) => {
                (serde_json::Value::Null, serde_json::Value::Null, Some(format!("stored JSON does not decode: {e}")))
            }
        };
        ClaimedGroup {
            id: self.id,
            policy_version: self.policy_version,
            trajectories,
            reward_mean: self.reward_mean,
            reward_std: self.reward_std,
            reward_count: self.reward_count,
            attempts: self.attempts,
            metadata,
            unusable,
        }
    }
}

impl ClaimedGroup {
    /// Each trajectory's reward, in order (validated finite numbers on insert).
    pub fn rewards(&self) -> Vec<f64> {
        let items = self.trajectories.as_array().map(Vec::as_slice).unwrap_or_default();
        items.iter().map(|t| t["reward"].as_f64().unwrap_or(f64::NAN)).collect()
    }

    /// The plain data [`crate::rl::filter_groups`] needs.
    pub fn to_group_rewards(&self) -> GroupRewards {
        GroupRewards {
            id: self.id,
            rewards: self.rewards(),
            policy_version: self.policy_version,
            unusable: self.unusable.clone(),
        }
    }
}

/// Claims up to `limit` pending groups of a model in one statement (`FOR UPDATE SKIP LOCKED`),
/// setting state `claimed`, a fresh claim token and `lease_expires_at = now + lease_seconds`.
///
/// With a [`PolicyWindow`], `limit` counts eligible groups only (oldest first), and up to
/// `too_old_limit` groups too old for any future step are claimed with them, so the step skips
/// them `stale` and records it. Groups whose `retry_after` lies ahead are left for later.
pub async fn claim_groups(pool: &PgPool, params: &ClaimParams) -> Result<Claim> {
    let token = ClaimToken::new();
    let eligible = eligible_sql("$7", "$8", "$9");
    let ready = ready_sql("coalesce($5, now())");
    let sql = format!(
        "WITH eligible AS ( \
             SELECT id FROM trainq.groups WHERE model = $1 AND state = 'pending' AND {ready} \
             AND ($7::bigint IS NULL OR {eligible}) ORDER BY id LIMIT $3 FOR UPDATE SKIP LOCKED), \
         too_old AS ( \
             SELECT id FROM trainq.groups WHERE model = $1 AND state = 'pending' AND {ready} AND $7::bigint IS NOT NULL \
             AND NOT {eligible} ORDER BY id LIMIT $10 FOR UPDATE SKIP LOCKED), \
         picked AS (SELECT id FROM eligible UNION ALL SELECT id FROM too_old) \
         UPDATE trainq.groups g \
         SET state = 'claimed', claim_token = $4, claimed_by = $2, claimed_at = coalesce($5, now()), \
             lease_expires_at = coalesce($5, now()) + make_interval(secs => $6) \
         FROM picked WHERE g.id = picked.id \
         RETURNING g.id, g.policy_version, g.trajectories::text AS trajectories, g.reward_mean, g.reward_std, \
                   g.reward_count, g.attempts, g.metadata::text AS metadata"
    );
    let window = params.window.as_ref();
    let rows: Vec<ClaimedRow> = sqlx::query_as(&sql)
        .bind(&params.model)
        .bind(&params.worker_id)
        .bind(params.limit)
        .bind(token)
        .bind(params.now)
        .bind(params.lease_seconds)
        .bind(window.map(|w| w.current_step))
        .bind(window.map_or(0, |w| w.accepted_staleness))
        .bind(window.map_or("stale", |w| w.unknown_policy_version.as_str()))
        .bind(window.map_or(0, |w| w.too_old_limit))
        .fetch_all(pool)
        .await
        .map_err(Error::db(format!("claim groups of model {:?}", params.model)))?;
    let mut groups: Vec<ClaimedGroup> = rows.into_iter().map(ClaimedRow::decode).collect();
    groups.sort_by_key(|g| g.id);
    Ok(Claim { token, model: params.model.clone(), groups })
}

/// Extends the lease of every group still held by `token` to `now + lease_seconds`; returns how
/// many; [`Error::LostClaim`] when none is held any more.
pub async fn extend_lease(pool: &PgPool, token: ClaimToken, lease_seconds: f64) -> Result<u64> {
    let done = sqlx::query(
        "UPDATE trainq.groups SET lease_expires_at = now() + make_interval(secs => $2) \
         WHERE claim_token = $1 AND state = 'claimed'",
    )
    .bind(token)
    .bind(lease_seconds)
    .execute(pool)
    .await
    .map_err(Error::db(format!("extend lease of claim {token}")))?;
    if done.rows_affected() == 0 {
        return Err(Error::LostClaim { model: format!("(claim {token})"), groups: 0 });
    }
    Ok(done.rows_affected())
}

/// Wraps a fenced `UPDATE` (no RETURNING) into one statement that raises SQLSTATE
/// [`sqlstate::LOST_CLAIM`] — so the statement, and any transaction around it, writes nothing —
/// unless it touched exactly `$expected` rows.
pub(crate) fn fenced(update: &str, expected: &str) -> String {
    format!(
        "WITH done AS ({update} RETURNING 1) \
         SELECT trainq.refuse('{}', format('claim lost: %s of %s group(s) no longer held by the token', \
                {expected} - c.n, {expected})) \
         FROM (SELECT count(*) AS n FROM done) c WHERE c.n <> {expected}",
        sqlstate::LOST_CLAIM
    )
}

/// Runs a query built by [`fenced`]; a lost claim becomes [`Error::LostClaim`] naming the model.
pub(crate) async fn execute_fenced<'q, 'e, E>(
    query: sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>,
    executor: E,
    pool: &PgPool,
    ids: &[GroupId],
    what: String,
) -> Result<()>
where
    E: sqlx::PgExecutor<'e>,
{
    match query.execute(executor).await {
        Ok(_) => Ok(()),
        Err(err) if sqlstate::code_of(&err).as_deref() == Some(sqlstate::LOST_CLAIM) => {
            let model: Option<String> =
                sqlx::query_scalar("SELECT model FROM trainq.groups WHERE id = ANY($1) LIMIT 1")
                    .bind(ids)
                    .fetch_optional(pool)
                    .await
                    .map_err(Error::db("look up the model of a lost claim"))?;
            Err(Error::LostClaim { model: model.unwrap_or_default(), groups: ids.len() })
        }
        Err(err) => Err(Error::db(what)(err)),
    }
}

const SKIP_UPDATE: &str = "\
    UPDATE trainq.groups g \
    SET state = 'skipped', skip_reason = s.reason::trainq.skip_reason, skip_std = s.std, \
        skip_detail = s.detail, finished_at = now() \
    FROM unnest($2::uuid[], $3::text[], $4::float8[], $5::text[]) AS s (id, reason, std, detail) \
    WHERE g.id = s.id AND g.claim_token = $1 AND g.state = 'claimed'";

/// Marks groups `skipped` with reason, std and detail through `executor` (a pool or an open
/// transaction), fenced on `token`.
pub(crate) async fn skip_with<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    pool: &PgPool,
    token: ClaimToken,
    skips: &[SkippedGroup],
) -> Result<()> {
    if skips.is_empty() {
        return Ok(());
    }
    let ids: Vec<GroupId> = skips.iter().map(|s| s.id).collect();
    let reasons: Vec<&str> = skips.iter().map(|s| s.reason.as_str()).collect();
    let stds: Vec<Option<f64>> = skips.iter().map(|s| s.std).collect();
    let details: Vec<Option<String>> = skips.iter().map(|s| s.detail.clone()).collect();
    let sql = fenced(SKIP_UPDATE, "$6::bigint");
    let query =
        sqlx::query(&sql).bind(token).bind(&ids).bind(&reasons).bind(&stds).bind(&details).bind(ids.len() as i64);
    execute_fenced(query, executor, pool, &ids, format!("skip {} group(s) of claim {token}", ids.len())).await
}

/// Marks groups `skipped` (zero_variance, stale, …) in one statement, fenced on `token`:
/// [`Error::LostClaim`] and nothing written if any group is no longer held by it.
pub async fn skip_groups(pool: &PgPool, token: ClaimToken, skips: &[SkippedGroup]) -> Result<()> {
    skip_with(pool, pool, token, skips).await
}

/// Marks groups `failed` with `error`, fenced on `token` (no retry; see [`release_groups`]).
pub async fn fail_groups(pool: &PgPool, token: ClaimToken, ids: &[GroupId], error: &str) -> Result<()> {
    let sql = fenced(
        "UPDATE trainq.groups SET state = 'failed', error = $3, finished_at = now() \
         WHERE id = ANY($2) AND claim_token = $1 AND state = 'claimed'",
        "$4::bigint",
    );
    let query = sqlx::query(&sql).bind(token).bind(ids).bind(error).bind(ids.len() as i64);
    execute_fenced(query, pool, pool, ids, format!("fail {} group(s) of claim {token}", ids.len())).await
}

/// Returns groups to `pending` without counting an attempt, fenced on `token`: for a clean
/// shutdown, where the worker gives up a step it could still have finished.
pub async fn unclaim_groups(pool: &PgPool, token: ClaimToken, ids: &[GroupId]) -> Result<()> {
    let sql = fenced(
        "UPDATE trainq.groups SET state = 'pending', claim_token = NULL, lease_expires_at = NULL \
         WHERE id = ANY($2) AND claim_token = $1 AND state = 'claimed'",
        "$3::bigint",
    );
    let query = sqlx::query(&sql).bind(token).bind(ids).bind(ids.len() as i64);
    execute_fenced(query, pool, pool, ids, format!("unclaim {} group(s) of claim {token}", ids.len())).await
}

/// Gives groups back after an error, fenced on `token`: attempts + 1, then `pending` again (not
/// claimable before its retry backoff is over), or `failed` once attempts reach the model's
/// `queue.max_attempts`; `error` is kept either way.
pub async fn release_groups(pool: &PgPool, token: ClaimToken, ids: &[GroupId], error: &str) -> Result<()> {
    let update = format!("{} g.id = ANY($5) AND g.claim_token = $4 AND g.state = 'claimed'", retry_or_fail());
    let sql = fenced(&update, "$6::bigint");
    let query = sqlx::query(&sql)
        .bind(error)
        .bind(DEFAULT_MAX_ATTEMPTS)
        .bind(None::<DateTime<Utc>>)
        .bind(token)
        .bind(ids)
        .bind(ids.len() as i64);
    execute_fenced(query, pool, pool, ids, format!("release {} group(s) of claim {token}", ids.len())).await
}

/// The update shared by release and rescue: $1 error text, $2 default max_attempts, $3 clock.
/// A group going back to pending waits `queue.retry_backoff_seconds × 2^(attempts − 1)`, at
/// most 16 times the base, before it can be claimed again (`retry_after`).
fn retry_or_fail() -> String {
    let max_attempts = "coalesce((m.config -> 'queue' ->> 'max_attempts')::int, $2)";
    let backoff = format!(
        "least(coalesce((m.config -> 'queue' ->> 'retry_backoff_seconds')::float8, {DEFAULT_RETRY_BACKOFF_SECONDS:?}), \
         {MAX_RETRY_BACKOFF_SECONDS:?})"
    );
    format!(
        "UPDATE trainq.groups g \
         SET attempts = g.attempts + 1, \
             state = CASE WHEN g.attempts + 1 >= {max_attempts} THEN 'failed' ELSE 'pending' END::trainq.group_state, \
             error = format('%s (attempt %s of %s, worker %s)', $1::text, g.attempts + 1, {max_attempts}, g.claimed_by), \
             finished_at = CASE WHEN g.attempts + 1 >= {max_attempts} THEN coalesce($3, now()) END, \
             retry_after = CASE WHEN g.attempts + 1 < {max_attempts} THEN coalesce($3, now()) \
                 + make_interval(secs => least({backoff} * 2::float8 ^ g.attempts, {backoff} * 16)) END, \
             claim_token = NULL, lease_expires_at = NULL \
         FROM trainq.models m WHERE m.name = g.model AND"
    )
}

/// What one rescuer pass did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RescueReport {
    /// Expired claims returned to pending.
    pub returned: u64,
    /// Expired claims that reached max_attempts and were marked failed.
    pub failed: u64,
}

/// Returns every group whose lease expired before `now` (default: the database clock) to
/// `pending` with attempts + 1 and a retry backoff, or marks it `failed` once attempts reach
/// `queue.max_attempts`.
pub async fn rescue_expired(pool: &PgPool, now: Option<DateTime<Utc>>) -> Result<RescueReport> {
    let (returned, failed): (i64, i64) = sqlx::query_as(&format!(
        "WITH expired AS ( \
             SELECT id FROM trainq.groups WHERE state = 'claimed' AND lease_expires_at < coalesce($3, now()) \
             FOR UPDATE SKIP LOCKED), \
         done AS ({} g.id IN (SELECT id FROM expired) AND g.state = 'claimed' RETURNING g.state) \
         SELECT count(*) FILTER (WHERE state = 'pending'), count(*) FILTER (WHERE state = 'failed') FROM done",
        retry_or_fail()
    ))
    .bind("lease expired")
    .bind(DEFAULT_MAX_ATTEMPTS)
    .bind(now)
    .fetch_one(pool)
    .await
    .map_err(Error::db("rescue expired claims"))?;
    Ok(RescueReport { returned: returned as u64, failed: failed as u64 })
}
