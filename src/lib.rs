//! trainq: reinforcement learning for language-model agents, fed from PostgreSQL.
//!
//! Agents write trajectory groups into `trainq.groups` with plain SQL (or [`submit_group`] from
//! Rust). A worker claims batches of groups, drops those with nothing to learn (zero reward
//! variance within the group, stale, invalid or too long) with a reason per group, computes
//! group-relative advantages, trains the policy with libtorch, uploads a checkpoint to object
//! storage and records the step — all fenced on the claim, so that every group ends trained,
//! skipped or failed, exactly once. Inference hosts follow the checkpoints with
//! [`wait_for_checkpoint`] and [`fetch_checkpoint`].
//!
//! This crate is the façade: the few types an embedder needs, re-exported from the two layers
//! below it. `trainq-queue` (PostgreSQL, object storage, config; no libtorch) and
//! `trainq-engine` (tch, CUDA, NCCL). Build with `default-features = false` for the queue side
//! alone: submitting groups and following checkpoints then need no libtorch.
//!
//! # Submit a group from Rust
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/trainq").await?;
//! let group = trainq::NewGroup {
//!     model: "my-model".into(),
//!     trajectories: serde_json::json!([
//!         {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], "reward": 1.0},
//!         {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}], "reward": 0.0},
//!     ]),
//!     policy_version: Some(trainq::StepNumber(0)),
//!     metadata: serde_json::json!({}),
//! };
//! let id = trainq::submit_group(&pool, &group).await?;
//! println!("group {id} is pending");
//! # Ok(()) }
//! ```
//!
//! # Wait for and fetch the latest checkpoint
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! let latest = trainq::wait_for_checkpoint(&pool, "my-model", trainq::StepNumber(0), Duration::from_secs(600)).await?;
//! let store = trainq::Store::open_with(&latest.store_url, &trainq::StoreOptions::default())?;
//! let dir = std::path::Path::new("/models/my-model/current");
//! trainq::fetch_checkpoint(&store, "my-model", latest.step, dir, &trainq::FetchOptions::default(), &|_| {}).await?;
//! # Ok(()) }
//! ```
//!
//! # Run a worker inside your own tokio program
//! ```no_run
//! # #[cfg(feature = "engine")]
//! # async fn demo(pool: sqlx::PgPool) -> trainq::Result<()> {
//! use tokio_util::sync::CancellationToken;
//! use trainq::worker::Placement;
//! let device = trainq_engine::tch::Device::Cuda(0);
//! let mut options = trainq::WorkerOptions::new("my-model", "s3://bucket/trainq", Placement::One(device));
//! options.max_steps = Some(100);
//! let shutdown = CancellationToken::new();
//! let on_signal = shutdown.clone();
//! tokio::spawn(async move {
//!     let _ = tokio::signal::ctrl_c().await;
//!     on_signal.cancel(); // the worker finishes or abandons its step and gives its claims back
//! });
//! let summary = trainq::run_worker(&pool, &options, shutdown).await?;
//! println!("{} steps committed", summary.steps.len());
//! # Ok(()) }
//! ```

#[cfg(feature = "engine")]
pub mod demo;
mod error;
pub mod follow;
pub mod report;
#[cfg(feature = "engine")]
pub mod worker;

pub use error::{Error, Result};
pub use trainq_queue::db::{group_status, submit_group, GroupStatus, NewGroup};
pub use trainq_queue::queue::{latest as latest_checkpoint, wait_for_checkpoint, LatestCheckpoint};
pub use trainq_queue::storage::{fetch_checkpoint, FetchOptions, Store, StoreOptions};
pub use trainq_queue::{migrate, ClaimToken, GroupId, StepNumber, TrainConfig};
#[cfg(feature = "engine")]
pub use worker::{run_worker, StepOutcome, WorkerOptions, WorkerSummary};
