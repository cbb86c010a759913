//! trainq's queue side: everything a producer, an inference host or a worker needs from
//! PostgreSQL and object storage, with no libtorch.
//!
//! Its documented surface is what a service that only submits groups or follows checkpoints
//! needs (the `trainq` crate re-exports the same items): [`migrate`], [`create_model`],
//! [`submit_group`], [`group_status`], [`latest`], [`wait_for_checkpoint`], [`Store`] and
//! [`fetch_checkpoint`], the typed [`config`], the id newtypes and one [`Error`].
//!
//! The modules behind them are public for the layers above (the worker, the CLI, the tests) and
//! hidden from these docs: `db` holds every SQL statement (one module per table) and the
//! embedded migrations; `queue` the long-running parts of claiming (lease heartbeats, the
//! rescuer, waiting for work with `LISTEN`, following checkpoints); `rl` pure math on plain data
//! (group filters, advantages); `storage` the checkpoint store (manifest, upload, fetch,
//! retention).
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> trainq_queue::Result<()> {
//! use serde_json::json;
//! trainq_queue::migrate(&pool).await?;
//! let group = trainq_queue::NewGroup {
//!     model: "my-model".into(),
//!     trajectories: json!([
//!         {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], "reward": 1.0},
//!         {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}], "reward": 0.0},
//!     ]),
//!     policy_version: Some(trainq_queue::StepNumber(0)),
//!     metadata: json!({}),
//! };
//! let id = trainq_queue::submit_group(&pool, &group).await?;
//! println!("submitted {id}");
//! # Ok(()) }
//! ```

pub mod config;
#[doc(hidden)]
pub mod db;
mod error;
mod ids;
#[doc(hidden)]
pub mod queue;
#[doc(hidden)]
pub mod rl;
#[doc(hidden)]
pub mod storage;

pub use config::TrainConfig;
pub use db::{create_model, group_status, migrate, submit_group, GroupStatus, Model, NewGroup, NewModel};
pub use error::{Error, Result};
pub use ids::{ClaimToken, GroupId, StepNumber};
pub use queue::{latest, wait_for_checkpoint, LatestCheckpoint};
pub use storage::{fetch_checkpoint, FetchOptions, Manifest, Store, StoreOptions};
