//! The per-model commit lock: a PostgreSQL session advisory lock that a worker holds from the
//! start of its checkpoint upload to the end of its step commit, so that two workers of one model
//! never upload the same step's objects at once, and a worker that finds the step already
//! committed gives up before overwriting that checkpoint in the store.
//!
//! The lock lives on a connection of its own, detached from the pool: closing it (or the process
//! dying) ends the session and so releases the lock; it can never leak back into the pool.

use sqlx::{Connection, PgConnection, PgPool};

use crate::error::{Error, Result};
use crate::ids::StepNumber;

/// A held commit lock of one model; released by [`CommitLock::release`] or by dropping it.
pub struct CommitLock {
    conn: PgConnection,
    model: String,
}

/// Waits for and takes the commit lock of `model`.
pub async fn lock_commits(pool: &PgPool, model: &str) -> Result<CommitLock> {
    let what = || format!("take the commit lock of model {model:?}");
    let mut conn = pool.acquire().await.map_err(Error::db(what()))?.detach();
    sqlx::query("SELECT pg_advisory_lock(hashtextextended('trainq.commit:' || $1, 0))")
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

    /// Releases the lock by closing its session.
    pub async fn release(self) {
        let _ = self.conn.close().await;
    }
}
