//! Table `trainq.workers`: workers register on start and heartbeat while they run.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::error::{Error, Result};

/// What a worker says about itself when it starts.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerInfo {
    /// Unique worker id (e.g. `host:pid`).
    pub id: String,
    /// Host name.
    pub host: String,
    /// Model it trains, if any.
    pub model: Option<String>,
    /// Devices, e.g. `["cuda:0", "cuda:1"]`.
    pub devices: serde_json::Value,
}

/// A registered worker.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Worker {
    /// Worker id.
    pub id: String,
    /// Host name.
    pub host: String,
    /// Model it trains.
    pub model: Option<String>,
    /// Devices.
    pub devices: serde_json::Value,
    /// When it (last) started.
    pub started_at: DateTime<Utc>,
    /// Its last heartbeat.
    pub heartbeat_at: DateTime<Utc>,
}

/// Registers (or re-registers) a worker, setting started and heartbeat to now.
pub async fn register_worker(pool: &PgPool, info: &WorkerInfo) -> Result<()> {
    sqlx::query(
        "INSERT INTO trainq.workers (id, host, model, devices) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (id) DO UPDATE SET host = EXCLUDED.host, model = EXCLUDED.model, devices = EXCLUDED.devices, \
             started_at = now(), heartbeat_at = now()",
    )
    .bind(&info.id)
    .bind(&info.host)
    .bind(&info.model)
    .bind(&info.devices)
    .execute(pool)
    .await
    .map_err(Error::db(format!("register worker {:?}", info.id)))?;
    Ok(())
}

/// Records a heartbeat of worker `id`.
pub async fn heartbeat_worker(pool: &PgPool, id: &str) -> Result<()> {
    sqlx::query("UPDATE trainq.workers SET heartbeat_at = now() WHERE id = $1")
        .bind(id)
        .execute(pool)
        .await
        .map_err(Error::db(format!("heartbeat of worker {id:?}")))?;
    Ok(())
}

/// Registered workers (of `model`, or all), most recent heartbeat first.
pub async fn list_workers(pool: &PgPool, model: Option<&str>) -> Result<Vec<Worker>> {
    sqlx::query_as(
        "SELECT id, host, model, devices, started_at, heartbeat_at FROM trainq.workers \
         WHERE $1::text IS NULL OR model = $1 ORDER BY heartbeat_at DESC",
    )
    .bind(model)
    .fetch_all(pool)
    .await
    .map_err(Error::db("list workers"))
}
