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
//! This crate is the façade: the few items an embedder needs, re-exported from the two layers
//! below it, `trainq-queue` (PostgreSQL, object storage, config; no libtorch) and
//! `trainq-engine` (tch, CUDA, NCCL). Build with `default-features = false` for the queue side
//! alone: submitting groups and following checkpoints then need no libtorch.
//!
//! Each entry point carries an example:
//! - install or upgrade the schema: [`migrate`]; register a model: [`create_model`];
//! - submit a group from Rust: [`submit_group`] (then [`group_status`]);
//! - wait for and fetch the latest checkpoint: [`wait_for_checkpoint`] and [`fetch_checkpoint`]
//!   (or [`latest_checkpoint`] to look without waiting);
//! - run a worker inside your own tokio program, stopped by your own [`CancellationToken`]:
//!   `run_worker` with `WorkerOptions` (feature `engine`, on by default).
//!
//! The queue-side functions return [`QueueError`]; `run_worker` returns [`Error`], which wraps
//! it and the engine's error. The modules behind these re-exports are public only for the
//! `trainq` binary and the tests, and are hidden from these docs.

#[cfg(feature = "engine")]
#[doc(hidden)]
pub mod demo;
mod error;
#[doc(hidden)]
pub mod follow;
#[doc(hidden)]
pub mod report;
#[cfg(feature = "engine")]
#[doc(hidden)]
pub mod worker;

pub use error::{Error, Result};
pub use tokio_util::sync::CancellationToken;
pub use trainq_queue::config;
pub use trainq_queue::config::TrainConfig;
pub use trainq_queue::db::StepRecord;
pub use trainq_queue::storage::RetentionPolicy;
pub use trainq_queue::Error as QueueError;
pub use trainq_queue::{group_status, GroupStatus, LatestCheckpoint, Model, NewGroup, NewModel};
pub use trainq_queue::{FetchOptions, Manifest, Store, StoreOptions};
pub use trainq_queue::{GroupId, StepNumber};

/// Installs or upgrades schema `trainq`; safe to call at every start.
///
/// # Example
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/trainq").await?;
/// trainq::migrate(&pool).await?; // idempotent: safe at every start
/// # Ok(()) }
/// ```
///
/// # Details
pub use trainq_queue::migrate;

/// Registers a model: its name, base weights and training config.
///
/// # Example
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), trainq::QueueError> {
/// let mut model = trainq::NewModel::new("my-model", "s3://bucket/base-models/Qwen3-0.6B");
/// model.config.queue.groups_per_step = 16;
/// let row = trainq::create_model(&pool, &model).await?;
/// println!("model {} at step {}", row.name, row.current_step);
/// # Ok(()) }
/// ```
///
/// # Details
pub use trainq_queue::create_model;

/// Submits a group of rollouts from Rust (the same as `INSERT INTO trainq.groups` from SQL).
///
/// # Example: submit a group from Rust
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), trainq::QueueError> {
/// let group = trainq::NewGroup {
///     model: "my-model".into(),
///     trajectories: serde_json::json!([
///         {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], "reward": 1.0},
///         {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}], "reward": 0.0},
///     ]),
///     policy_version: Some(trainq::StepNumber(0)), // the checkpoint step the rollouts were sampled from
///     metadata: serde_json::json!({}),
/// };
/// let id = trainq::submit_group(&pool, &group).await?;
/// let status = trainq::group_status(&pool, id).await?.expect("just submitted");
/// println!("group {id} is {}", status.state);
/// # Ok(()) }
/// ```
///
/// # Details
pub use trainq_queue::submit_group;

/// The newest committed checkpoint, without waiting: the step a producer samples from.
///
/// # Example
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), trainq::QueueError> {
/// // Sample the next rollouts from the newest checkpoint (the base model before the first).
/// let version = trainq::latest_checkpoint(&pool, "my-model").await?.map_or(trainq::StepNumber::BASE, |c| c.step);
/// println!("sample from step {version}");
/// # Ok(()) }
/// ```
///
/// # Details
pub use trainq_queue::latest as latest_checkpoint;

/// Waits, woken by `LISTEN`, for a checkpoint newer than the one you have.
///
/// # Example
/// An inference host's loop is on [`fetch_checkpoint`].
///
/// # Details
pub use trainq_queue::wait_for_checkpoint;

/// Downloads a committed checkpoint and verifies every file against its manifest.
///
/// # Example: wait for and fetch the latest checkpoint
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), trainq::QueueError> {
/// use std::time::Duration;
/// let mut have = trainq::StepNumber::BASE;
/// loop {
///     let latest = match trainq::wait_for_checkpoint(&pool, "my-model", have, Duration::from_secs(600)).await {
///         Ok(latest) => latest,
///         Err(trainq::QueueError::NotFound { .. }) => continue, // nothing new within the timeout
///         Err(err) => return Err(err),
///     };
///     let store = trainq::Store::open_with(&latest.store_url, &trainq::StoreOptions::default())?;
///     let dir = std::path::PathBuf::from(format!("/models/my-model/{:06}", latest.step));
///     let options = trainq::FetchOptions { replace_existing: true, ..Default::default() };
///     let manifest = trainq::fetch_checkpoint(&store, "my-model", latest.step, &dir, &options, &|_| {}).await?;
///     println!("step {} in {} ({} bytes, verified)", latest.step, dir.display(), manifest.total_bytes);
///     have = latest.step;
/// }
/// # }
/// ```
///
/// # Details
pub use trainq_queue::fetch_checkpoint;

#[cfg(feature = "engine")]
pub use trainq_engine::tch::Device;
#[cfg(feature = "engine")]
pub use trainq_engine::Error as EngineError;
#[cfg(feature = "engine")]
pub use worker::{ConfigOverrides, Placement, StepOutcome, WorkerOptions, WorkerSummary};

/// Runs a worker in your own tokio program until your token fires (or `max_steps`, or idle).
///
/// # Example: run a worker inside your own tokio program, with your own shutdown signal
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> trainq::Result<()> {
/// let placement = trainq::Placement::One(trainq::Device::Cuda(0));
/// let mut options = trainq::WorkerOptions::new("my-model", "s3://bucket/trainq", placement);
/// options.max_steps = Some(100);
/// let shutdown = trainq::CancellationToken::new();
/// let on_signal = shutdown.clone();
/// tokio::spawn(async move {
///     let _ = tokio::signal::ctrl_c().await;
///     on_signal.cancel(); // the step in flight is finished or abandoned, its claim given back
/// });
/// let summary = trainq::run_worker(&pool, &options, shutdown).await?;
/// println!("{} steps committed, {} abandoned", summary.steps.len(), summary.abandoned);
/// # Ok(()) }
/// ```
///
/// # Details
#[cfg(feature = "engine")]
pub use worker::run_worker;
