//! trainq: reinforcement learning for language-model agents, fed from PostgreSQL.
//!
//! Agents write trajectory groups into `trainq.groups` with plain SQL. A worker claims batches of
//! groups, drops those with nothing to learn (zero reward variance within the group, stale,
//! invalid or too long) with a reason per group, computes group-relative advantages, trains the
//! policy with libtorch, uploads a checkpoint to object storage and records the step — all
//! fenced on the claim so that every group ends trained, skipped or failed, exactly once.
//!
//! Layers (dependencies point downward only): [`db`] holds every SQL statement; [`queue`] claims,
//! heartbeats and rescues; [`rl`] is pure math on plain data; [`tokenize`] turns trajectories
//! into ids and masks; [`model`] is the tch transformer, LoRA and loss; [`dist`] the NCCL
//! collective; [`checkpoint`] writes, uploads and fetches weights; [`train`] runs one optimizer
//! step; [`worker`] joins them. See docs/architecture.md.

pub mod checkpoint;
pub mod config;
pub mod db;
pub mod demo;
pub mod dist;
pub mod error;
pub mod kernels;
pub mod model;
pub mod queue;
pub mod rl;
pub mod tokenize;
pub mod train;
pub mod worker;

pub use config::TrainConfig;
pub use db::migrate;
pub use error::{Error, Result};
