//! Table `trainq.commit_locks`: the per-model commit lock, a row lock (`SELECT … FOR UPDATE`)
//! that a worker holds from the start of its checkpoint upload to the end of its step commit, so
//! that two workers of one model never upload the same step's objects at once, and a worker that
//! finds the step already committed gives up before overwriting that checkpoint in the store.
//!
//! Locking a row needs UPDATE on its table, which only `trainq_worker` (and the owner) has: a
//! producer cannot take the lock and stall commits (it could with the session advisory lock of
//! migrations before 0010, whose key anyone may lock).
//!
//! The lock lives in an open transaction on a connection of its own, detached from the pool:
//! closing it (or the process dying) ends the transaction and so releases the lock; it can never
//! leak back into the pool. The transaction holds a transaction id while the upload runs, so
//! VACUUM cannot remove rows that die meanwhile until the commit; the session turns
//! `idle_in_transaction_session_timeout` off, so a long upload does not lose the lock to it.

use sqlx::{Connection, PgConnection, PgPool};

use crate::error::{Error, Result};
use crate::ids::StepNumber;

/// A held commit lock of one model; released by [`CommitLock::release`] or by dropping it.
pub struct CommitLock {
    conn: PgConnection,
    model: String,
}

/// Waits for and takes the commit lock of `model` (adding the model's lock row on first use).
pub async fn lock_commits(pool: &PgPool, model: &str) -> Result<CommitLock> {
    let what = || format!("take the commit lock of model {model:?}");
    let mut conn = pool.acquire().await.map_err(Error::db(what()))?.detach();
    sqlx::query("SET idle_in_transaction_session_timeout = 0").execute(&mut conn).await.map_err(Error::db(what()))?;
    sqlx::query("INSERT INTO trainq.commit_locks (model) VALUES ($1) ON CONFLICT DO NOTHING")
        .bind(model)
        .execute(&mut conn)
        .await
        .map_err(Error::db(what()))?;
    // Read committed whatever the server's default: `current_step` must see the holder's commit.
    sqlx::query("BEGIN ISOLATION LEVEL READ COMMITTED")
        .persistent(false)
        .execute(&mut conn)
        .await
        .map_err(Error::db(what()))?;
    sqlx::query("SELECT model FROM trainq.commit_locks WHERE model = $1 FOR UPDATE")
        .bind(model)
        .execute(&mut conn)
        .await
        .map_err(Error::db(what()))?;
    Ok(CommitLock { conn, model: model.to_string() })
}

impl CommitLock {
    /// The model's `current_step`, read on the lock's own connection.
    pub async fn current_step(&mut self) -> Result<StepNumber> {
        sqlx::query_scalar("SELECT current_step FROM trainq.models WHERE name = $1")
            .bind(&self.model)
            .fetch_one(&mut self.conn)
            .await
            .map_err(Error::db(format!("current step of model {:?}", self.model)))
    }

    /// Releases the lock by closing its session (which ends its transaction).
    pub async fn release(self) {
        let _ = self.conn.close().await;
    }
}
