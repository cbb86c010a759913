//! A test hook for fault-injection tests: pause the worker at a named phase of a step so a test
//! can kill it (`kill -9`) or break its surroundings (stop the object store) at that exact point.
//!
//! Set `TRAINQ_FAULT_PAUSE_AT=train` (before the optimizer step) or `=upload` (after the
//! checkpoint is saved locally, before it is uploaded). At that phase the worker prints the line
//! `TRAINQ_FAULT_PAUSED phase=<phase> step=<n>` to stderr and waits: forever, or, when
//! `TRAINQ_FAULT_RESUME_FILE=<path>` is set, until that file exists (then it continues as if
//! nothing happened). Heartbeats keep the claim's lease alive while paused. Only the first step
//! that reaches the phase pauses. Unset (the normal case), the hook costs one env lookup.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Environment variable naming the phase to pause at (`train` or `upload`).
pub const FAULT_PAUSE_AT_ENV: &str = "TRAINQ_FAULT_PAUSE_AT";
/// Environment variable naming a file whose appearance ends the pause.
pub const FAULT_RESUME_FILE_ENV: &str = "TRAINQ_FAULT_RESUME_FILE";
/// Start of the marker line printed to stderr when paused.
pub const FAULT_PAUSED_MARKER: &str = "TRAINQ_FAULT_PAUSED";

static PAUSED_ONCE: AtomicBool = AtomicBool::new(false);

/// Pauses here when `TRAINQ_FAULT_PAUSE_AT` names `phase` (see the module docs).
pub(crate) async fn pause_if_requested(phase: &str, step: trainq_queue::StepNumber) {
    if std::env::var(FAULT_PAUSE_AT_ENV).ok().as_deref() != Some(phase) || PAUSED_ONCE.swap(true, Ordering::SeqCst) {
        return;
    }
    eprintln!("{FAULT_PAUSED_MARKER} phase={phase} step={step}");
    let resume_file = std::env::var_os(FAULT_RESUME_FILE_ENV).map(PathBuf::from);
    loop {
        if resume_file.as_ref().is_some_and(|f| f.exists()) {
            eprintln!("TRAINQ_FAULT_RESUMED phase={phase} step={step}");
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
