//! Claiming groups, lease heartbeats, the rescuer and notifications, on top of `db`.
//!
//! The SQL lives in [`crate::db::claims`]; this module adds the long-running parts a worker needs:
//! a heartbeat task per claim ([`lease`]), a periodic rescuer ([`rescuer`]) and waiting for work
//! with `LISTEN trainq_groups` plus a poll fallback ([`wait`]), on a LISTEN connection that is
//! re-established when lost ([`listener`]).

pub mod checkpoints;
pub mod lease;
pub mod listener;
pub mod rescuer;
pub mod wait;

pub use crate::db::claims::{
    claim_groups, extend_lease, fail_groups, release_groups, rescue_expired, skip_groups, Claim, ClaimParams,
    ClaimedGroup, PolicyWindow, RescueReport,
};
pub use checkpoints::{latest, wait_for_checkpoint, LatestCheckpoint, CHECKPOINTS_CHANNEL};
pub use lease::{spawn_lease_heartbeat, LeaseHeartbeat};
pub use listener::{Listener, Wake};
pub use rescuer::spawn_rescuer;
pub use wait::{wait_for_groups, BatchReadiness, GroupWaiter, DEFAULT_POLL_INTERVAL, GROUPS_CHANNEL};
