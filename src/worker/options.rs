//! How a worker runs: which model and store, on which device, and the per-worker overrides of
//! the model's stored training config.

use std::path::PathBuf;
use std::time::Duration;

use trainq_engine::engine::Placement;
use trainq_queue::config::TrainConfig;
use trainq_queue::storage::{RetentionPolicy, StoreOptions};

/// Default interval of the poll fallback when no notification arrives.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(2);
/// Default pause between upload attempts while the object store is unreachable.
pub const DEFAULT_UPLOAD_RETRY_PAUSE: Duration = Duration::from_secs(2);

/// Settings of one worker process.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// Model to train (its row in `trainq.models`).
    pub model: String,
    /// This worker's id (`claimed_by`, `steps.worker_id`); host name and pid by default.
    pub worker_id: String,
    /// Object store URL checkpoints go to (`s3://bucket/prefix`, `file:///dir`, `memory://`).
    pub store_url: String,
    /// How to reach the store (credentials, endpoint, retries); by default from the environment.
    pub store_options: StoreOptions,
    /// Where the engine's ranks run: one device, several GPUs (NCCL), or CPU ranks (tests).
    pub placement: Placement,
    /// Local directory for the base model copy, staged checkpoints and fetched checkpoints.
    pub work_dir: PathBuf,
    /// Overrides of the model's stored config (queue settings and the like).
    pub overrides: ConfigOverrides,
    /// Poll interval when no notification wakes the worker.
    pub poll_interval: Duration,
    /// Stop after this many committed steps (demo, tests); `None` runs until shut down.
    pub max_steps: Option<u64>,
    /// Stop after waiting this long with no pending group (demo, tests); `None` waits forever.
    pub stop_when_idle_for: Option<Duration>,
    /// Which checkpoints to keep in the store.
    pub retention: RetentionPolicy,
    /// Pause between upload attempts while the store is unreachable.
    pub upload_retry_pause: Duration,
    /// Serve Prometheus metrics on this address (`GET /metrics`); `None` (default) serves none.
    pub metrics_addr: Option<std::net::SocketAddr>,
}

impl WorkerOptions {
    /// Options with defaults for everything but the model, the store and where to train.
    pub fn new(model: impl Into<String>, store_url: impl Into<String>, placement: Placement) -> Self {
        let model = model.into();
        WorkerOptions {
            worker_id: default_worker_id(),
            work_dir: std::env::temp_dir().join("trainq").join(&model),
            model,
            store_url: store_url.into(),
            store_options: StoreOptions::default(),
            placement,
            overrides: ConfigOverrides::default(),
            poll_interval: DEFAULT_POLL_INTERVAL,
            max_steps: None,
            stop_when_idle_for: None,
            retention: RetentionPolicy::default(),
            upload_retry_pause: DEFAULT_UPLOAD_RETRY_PAUSE,
            metrics_addr: None,
        }
    }
}

/// `host:pid`, unique enough to tell workers apart in `trainq status`.
pub fn default_worker_id() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into());
    format!("{host}:{}", std::process::id())
}

/// Per-worker settings that take precedence over the model's stored config.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConfigOverrides {
    /// `queue.groups_per_step`.
    pub groups_per_step: Option<usize>,
    /// `queue.async_weight_syncing`.
    pub async_weight_syncing: Option<bool>,
    /// `queue.max_staleness`.
    pub max_staleness: Option<i64>,
    /// `optimizer.learning_rate`.
    pub learning_rate: Option<f64>,
}

impl ConfigOverrides {
    /// The model's config with these overrides applied.
    pub fn apply(&self, mut cfg: TrainConfig) -> TrainConfig {
        if let Some(n) = self.groups_per_step {
            cfg.queue.groups_per_step = n;
        }
        if let Some(flag) = self.async_weight_syncing {
            cfg.queue.async_weight_syncing = flag;
        }
        if let Some(n) = self.max_staleness {
            cfg.queue.max_staleness = n;
        }
        if let Some(lr) = self.learning_rate {
            cfg.optimizer.learning_rate = lr;
        }
        cfg
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_replace_only_what_they_name() {
        let base = TrainConfig::default();
        let cfg = ConfigOverrides { async_weight_syncing: Some(true), max_staleness: Some(4), ..Default::default() }
            .apply(base.clone());
        assert!(cfg.queue.async_weight_syncing);
        assert_eq!(cfg.queue.max_staleness, 4);
        assert_eq!(cfg.queue.groups_per_step, base.queue.groups_per_step);
        assert_eq!(cfg.optimizer, base.optimizer);
    }
}
