//! Claiming groups, lease heartbeats, the rescuer and notifications, on top of `db`.
