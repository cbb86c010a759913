//! How a worker runs: which model and store, on which device, and the per-worker overrides of
//! the model's stored training config.

use std::path::PathBuf;
use std::time::Duration;

use tch::Device;

use crate::checkpoint::{RetentionPolicy, StoreOptions};
use crate::config::TrainConfig;

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
    /// Training device (of the single engine; ignored when `data_parallel` names ranks).
    pub device: Device,
    /// Data-parallel ranks instead of one engine on `device`.
    pub data_parallel: DataParallel,
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
}

impl WorkerOptions {
    /// Options with defaults for everything but the model, store and device.
    pub fn new(model: impl Into<String>, store_url: impl Into<String>, device: Device) -> Self {
        let model = model.into();
        WorkerOptions {
            worker_id: default_worker_id(),
            work_dir: std::env::temp_dir().join("trainq").join(&model),
            model,
            store_url: store_url.into(),
            store_options: StoreOptions::default(),
            device,
            data_parallel: DataParallel::Off,
            overrides: ConfigOverrides::default(),
            poll_interval: DEFAULT_POLL_INTERVAL,
            max_steps: None,
            stop_when_idle_for: None,
            retention: RetentionPolicy::default(),
            upload_retry_pause: DEFAULT_UPLOAD_RETRY_PAUSE,
        }
    }
}

/// Whether a worker trains one replica or data-parallel ranks, each a full replica, that split
/// every step's micro-batches and sum their gradients.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum DataParallel {
    /// One engine on [`WorkerOptions::device`].
    #[default]
    Off,
    /// One rank per listed CUDA ordinal, gradients summed through NCCL (`trainq worker --gpus`).
    Gpus(Vec<usize>),
    /// This many ranks on the CPU over the in-process collective: the data-parallel code path
    /// without GPUs, for tests and debugging.
    CpuRanks(usize),
}

impl DataParallel {
    /// From `--gpus`: `all` (every visible CUDA device) or a count `N` (the first N); 1 GPU or
    /// `all` on a one-GPU host means no ranks. `visible` is the number of CUDA devices.
    pub fn from_gpus_flag(text: &str, visible: usize) -> std::result::Result<DataParallel, String> {
        let wanted = match text.trim() {
            "all" => visible,
            n => n.parse::<usize>().map_err(|_| format!("--gpus {n:?}: expected `all` or a number of GPUs"))?,
        };
        if wanted == 0 {
            return Err(format!("--gpus {text}: no CUDA device is visible (CUDA devices: {visible})"));
        }
        if wanted > visible {
            return Err(format!("--gpus {text}: only {visible} CUDA device(s) are visible"));
        }
        Ok(if wanted == 1 { DataParallel::Off } else { DataParallel::Gpus((0..wanted).collect()) })
    }

    /// The devices the worker trains on, as `trainq.workers.devices` lists them.
    pub fn device_names(&self, single: Device) -> Vec<String> {
        match self {
            DataParallel::Off => vec![super::device_name(single)],
            DataParallel::Gpus(ordinals) => ordinals.iter().map(|&i| super::device_name(Device::Cuda(i))).collect(),
            DataParallel::CpuRanks(n) => vec![super::device_name(Device::Cpu); *n],
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
    fn gpus_flag_counts_devices_and_refuses_what_is_not_there() {
        assert_eq!(DataParallel::from_gpus_flag("all", 4), Ok(DataParallel::Gpus(vec![0, 1, 2, 3])));
        assert_eq!(DataParallel::from_gpus_flag("2", 4), Ok(DataParallel::Gpus(vec![0, 1])));
        assert_eq!(DataParallel::from_gpus_flag("1", 4), Ok(DataParallel::Off));
        assert_eq!(DataParallel::from_gpus_flag("all", 1), Ok(DataParallel::Off));
        assert!(DataParallel::from_gpus_flag("8", 4).unwrap_err().contains("only 4"));
        assert!(DataParallel::from_gpus_flag("all", 0).unwrap_err().contains("no CUDA device"));
        assert!(DataParallel::from_gpus_flag("two", 4).unwrap_err().contains("expected"));
        assert_eq!(DataParallel::Gpus(vec![0, 1]).device_names(Device::Cpu), vec!["cuda:0", "cuda:1"]);
    }

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
