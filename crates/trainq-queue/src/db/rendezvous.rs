//! Table `trainq.rendezvous`: rank 0 of a data-parallel group publishes its NCCL unique id; the
//! other ranks (on any host) wait for it and join.
//!
//! A rendezvous is keyed by (model, generation). It is stale once `expires_at` has passed or,
//! for a given rank, once that rank has joined it; a stale rendezvous is never handed out, so a
//! rank restarted after a crash waits for rank 0's fresh id instead of an NCCL group that no
//! longer exists. The id travels as hex: this module knows nothing of NCCL.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::error::{Error, Result};

/// How long a published id may be joined, unless the caller says otherwise.
pub const DEFAULT_RENDEZVOUS_TTL: Duration = Duration::from_secs(600);

/// How often [`wait_for_unique_id`] asks the database again.
pub const RENDEZVOUS_POLL_INTERVAL: Duration = Duration::from_millis(100);

/// One published id and who has taken it.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Rendezvous {
    /// Model the group trains.
    pub model: String,
    /// Which start of the group.
    pub generation: i64,
    /// Ranks in the group.
    pub world_size: i32,
    /// Rank 0's NCCL unique id, 256 hex digits.
    pub nccl_unique_id: String,
    /// Ranks that have taken the id, rank 0 first.
    pub joined_ranks: Vec<i32>,
    /// When rank 0 published it.
    pub created_at: DateTime<Utc>,
    /// When it becomes stale.
    pub expires_at: DateTime<Utc>,
}

/// What rank 0 publishes.
#[derive(Debug, Clone, PartialEq)]
pub struct PublishParams<'a> {
    /// Model the group trains.
    pub model: &'a str,
    /// Which start of the group (every rank passes the same number).
    pub generation: i64,
    /// Ranks in the group.
    pub world_size: i32,
    /// Rank 0's NCCL unique id as hex.
    pub nccl_unique_id: &'a str,
    /// How long the id may be joined.
    pub ttl: Duration,
    /// The time to publish at (None: the database's `now()`); tests pass a time.
    pub now: Option<DateTime<Utc>>,
}

const COLUMNS: &str = "model, generation, world_size, nccl_unique_id, joined_ranks, created_at, expires_at";

/// Rank 0: publishes `params.nccl_unique_id` for (model, generation), replacing any earlier id
/// of the same key (a restarted group) and deleting the model's expired rendezvous.
pub async fn publish_unique_id(pool: &PgPool, params: &PublishParams<'_>) -> Result<Rendezvous> {
    let what = || format!("publish the NCCL id of model {:?} generation {}", params.model, params.generation);
    let mut tx = pool.begin().await.map_err(Error::db(what()))?;
    sqlx::query("DELETE FROM trainq.rendezvous WHERE model = $1 AND expires_at <= coalesce($2, now())")
        .bind(params.model)
        .bind(params.now)
        .execute(&mut *tx)
        .await
        .map_err(Error::db(what()))?;
    let published = sqlx::query_as(&format!(
        "INSERT INTO trainq.rendezvous (model, generation, world_size, nccl_unique_id, joined_ranks, created_at, expires_at) \
         VALUES ($1, $2, $3, $4, '{{0}}', coalesce($5, now()), coalesce($5, now()) + make_interval(secs => $6)) \
         ON CONFLICT (model, generation) DO UPDATE SET world_size = EXCLUDED.world_size, \
             nccl_unique_id = EXCLUDED.nccl_unique_id, joined_ranks = EXCLUDED.joined_ranks, \
             created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at \
         RETURNING {COLUMNS}"
    ))
    .bind(params.model)
    .bind(params.generation)
    .bind(params.world_size)
    .bind(params.nccl_unique_id)
    .bind(params.now)
    .bind(params.ttl.as_secs_f64())
    .fetch_one(&mut *tx)
    .await
    .map_err(Error::db(what()))?;
    tx.commit().await.map_err(Error::db(what()))?;
    Ok(published)
}

/// Rank `rank` (≥ 1): takes the id of (model, generation) if it is published, unexpired at
/// `now` (None: the database's clock) and not yet taken by this rank; records the rank as
/// joined. `Ok(None)`: nothing to join yet. A live rendezvous for another world size is an error.
pub async fn join_rendezvous(
    pool: &PgPool,
    model: &str,
    generation: i64,
    rank: i32,
    world_size: i32,
    now: Option<DateTime<Utc>>,
) -> Result<Option<String>> {
    let what = || format!("join rendezvous of model {model:?} generation {generation} as rank {rank}/{world_size}");
    if rank < 1 || rank >= world_size {
        return Err(Error::config("rank", format!("{}: rank must be in 1..{world_size}", what())));
    }
    let joined: Option<String> = sqlx::query_scalar(
        "UPDATE trainq.rendezvous SET joined_ranks = array_append(joined_ranks, $3) \
         WHERE model = $1 AND generation = $2 AND world_size = $4 AND expires_at > coalesce($5, now()) \
           AND NOT ($3 = ANY (joined_ranks)) \
         RETURNING nccl_unique_id",
    )
    .bind(model)
    .bind(generation)
    .bind(rank)
    .bind(world_size)
    .bind(now)
    .fetch_optional(pool)
    .await
    .map_err(Error::db(what()))?;
    if joined.is_some() {
        return Ok(joined);
    }
    let live_world_size: Option<i32> = sqlx::query_scalar(
        "SELECT world_size FROM trainq.rendezvous WHERE model = $1 AND generation = $2 AND expires_at > coalesce($3, now())",
    )
    .bind(model)
    .bind(generation)
    .bind(now)
    .fetch_optional(pool)
    .await
    .map_err(Error::db(what()))?;
    match live_world_size {
        Some(published) if published != world_size => {
            Err(Error::config("world_size", format!("{}: rank 0 published world size {published}", what())))
        }
        _ => Ok(None),
    }
}

/// Rank `rank` (≥ 1): polls [`join_rendezvous`] until it returns the id or `timeout` passes.
pub async fn wait_for_unique_id(
    pool: &PgPool,
    model: &str,
    generation: i64,
    rank: i32,
    world_size: i32,
    timeout: Duration,
) -> Result<String> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(id) = join_rendezvous(pool, model, generation, rank, world_size, None).await? {
            return Ok(id);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::Rendezvous(format!(
                "rank {rank}/{world_size} of model {model:?} generation {generation}: no fresh NCCL id from rank 0 within {timeout:?}"
            )));
        }
        tokio::time::sleep(RENDEZVOUS_POLL_INTERVAL.min(deadline - tokio::time::Instant::now())).await;
    }
}

/// The rendezvous of (model, generation), fresh or stale, if any.
pub async fn get_rendezvous(pool: &PgPool, model: &str, generation: i64) -> Result<Option<Rendezvous>> {
    sqlx::query_as(&format!("SELECT {COLUMNS} FROM trainq.rendezvous WHERE model = $1 AND generation = $2"))
        .bind(model)
        .bind(generation)
        .fetch_optional(pool)
        .await
        .map_err(Error::db(format!("read rendezvous of model {model:?} generation {generation}")))
}
