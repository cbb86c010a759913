//! The only Rust code that holds SQL: one module per table, and the embedded migrations.
//!
//! Tables and producer functions are created by `migrations/` (see docs/sql-api.md). Every query
//! here takes a `&PgPool` (or a transaction) and maps driver errors into [`crate::Error`] with the
//! operation, model and group they concern.

pub mod claims;
pub mod commit_lock;
pub mod databases;
pub mod groups;
pub mod models;
pub mod rendezvous;
pub mod skipped_passes;
pub mod sqlstate;
pub mod steps;
pub mod workers;

use sqlx::PgPool;

use crate::error::Result;

pub use claims::{
    claim_groups, extend_lease, fail_groups, release_groups, rescue_expired, skip_groups, unclaim_groups, Claim,
    ClaimParams, ClaimedGroup, PolicyWindow, RescueReport,
};
pub use groups::{
    count_claimable, count_pending, group_status, has_pending, queue_counts, submit_group, ClaimableGroups,
    GroupStatus, NewGroup, QueueCounts,
};
pub use models::{create_model, get_model, list_models, Model, NewModel};
pub use rendezvous::{
    get_rendezvous, join_rendezvous, publish_unique_id, wait_for_unique_id, PublishParams, Rendezvous,
    DEFAULT_RENDEZVOUS_TTL, RENDEZVOUS_POLL_INTERVAL,
};
pub use skipped_passes::{list_skipped_passes, record_skipped_pass, SkippedPass};
pub use steps::{
    all_steps, commit_step, deleted_checkpoint_steps, latest_checkpoint, list_steps, mark_checkpoints_deleted,
    CheckpointRecord, StepRecord,
};
pub use workers::{heartbeat_worker, list_workers, register_worker, Worker, WorkerInfo};

/// The migrations in `migrations/`, embedded in the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations");

/// Installs or upgrades schema `trainq` (tables, producer functions, roles) on `pool`'s database.
pub async fn migrate(pool: &PgPool) -> Result<()> {
    MIGRATOR.run(pool).await?;
    Ok(())
}
