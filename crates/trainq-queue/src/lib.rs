//! trainq's queue side: everything a producer, an inference host or a worker needs from
//! PostgreSQL and object storage, with no libtorch.
//!
//! - [`db`] holds every SQL statement (one module per table) and the embedded migrations.
//! - [`queue`] adds the long-running parts of claiming: lease heartbeats, the rescuer, waiting
//!   for work with `LISTEN`.
//! - [`rl`] is pure math on plain data: group filters and advantages.
//! - [`storage`] is the checkpoint store: manifest, upload, fetch, retention.
//! - [`config`] is the typed training config stored on each model row.
//!
//! The `trainq` crate re-exports the parts an embedder needs; this crate is the layer below it,
//! and the whole of what a service that only submits groups or follows checkpoints has to build.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> trainq_queue::Result<()> {
//! use serde_json::json;
//! trainq_queue::migrate(&pool).await?;
//! let group = trainq_queue::db::NewGroup {
//!     model: "my-model".into(),
//!     trajectories: json!([
//!         {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], "reward": 1.0},
//!         {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}], "reward": 0.0},
//!     ]),
//!     policy_version: Some(trainq_queue::StepNumber(0)),
//!     metadata: json!({}),
//! };
//! let id = trainq_queue::db::submit_group(&pool, &group).await?;
//! println!("submitted {id}");
//! # Ok(()) }
//! ```

pub mod config;
pub mod db;
mod error;
mod ids;
pub mod queue;
pub mod rl;
pub mod storage;

pub use config::TrainConfig;
pub use db::migrate;
pub use error::{Error, Result};
pub use ids::{ClaimToken, GroupId, StepNumber};
