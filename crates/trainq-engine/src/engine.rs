//! The training actor the worker talks to: a [`RankGroup`] of one thread per rank, each owning
//! its policy replica, optimizer and device. A single GPU (or the CPU) is a group of one, so
//! there is one loop for every placement; `--gpus N` is N ranks over NCCL, and
//! [`Placement::CpuRanks`] runs the data-parallel path on the CPU for tests.
//!
//! Jobs: [`Engine::train`] (one synchronized optimizer step, cancellable between micro-batches),
//! [`Engine::save`] (rank 0 writes the checkpoint; every replica holds the same weights) and
//! [`Engine::restore`] (every rank reloads the base model and a checkpoint).

use std::path::{Path, PathBuf};

use tch::Device;
use tokio_util::sync::CancellationToken;
use trainq_queue::config::TrainConfig;
use trainq_queue::storage::CheckpointFormat;

use crate::checkpoint::io as checkpoint_io;
use crate::collective::{local_group, NcclUniqueId, SingleRank};
use crate::error::{Error, Result};
use crate::model::Policy;
use crate::tokenize::MicroBatch;
use crate::train::{agree_on_success, RankGroup, RankReplica, StepMetrics, Trainer};

/// Where the engine's ranks run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// One rank on one device (a GPU or the CPU).
    One(Device),
    /// One rank per listed CUDA ordinal, gradients summed through NCCL.
    Gpus(Vec<usize>),
    /// This many ranks on the CPU over the in-process collective (the data-parallel path
    /// without GPUs, for tests).
    CpuRanks(usize),
}

impl Placement {
    /// From `--gpus`: `all` (every visible CUDA device) or a count `N` (the first N); one GPU
    /// (or `all` on a one-GPU host) is [`Placement::One`] on `cuda:0`. `visible` is the number
    /// of CUDA devices.
    pub fn from_gpus_flag(text: &str, visible: usize) -> std::result::Result<Placement, String> {
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
        Ok(if wanted == 1 { Placement::One(Device::Cuda(0)) } else { Placement::Gpus((0..wanted).collect()) })
    }

    /// The devices of the ranks, as `trainq.workers.devices` lists them (`cpu`, `cuda:N`).
    pub fn device_names(&self) -> Vec<String> {
        match self {
            Placement::One(device) => vec![device_name(*device)],
            Placement::Gpus(ordinals) => ordinals.iter().map(|&i| device_name(Device::Cuda(i))).collect(),
            Placement::CpuRanks(n) => vec![device_name(Device::Cpu); *n],
        }
    }
}

/// `cpu` or `cuda:N`.
pub fn device_name(device: Device) -> String {
    match device {
        Device::Cuda(n) => format!("cuda:{n}"),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// The ranks and what reloading a replica needs.
pub struct Engine {
    group: RankGroup,
    base_dir: PathBuf,
    cfg: TrainConfig,
}

impl Engine {
    /// Starts the ranks of `placement` (each loads the base model from `base_dir`; replicas take
    /// rank 0's adapters), then loads `resume_from` into every replica. Returns once all are ready.
    pub async fn start(
        base_dir: &Path,
        cfg: &TrainConfig,
        placement: &Placement,
        resume_from: Option<&Path>,
    ) -> Result<Engine> {
        let (dir, config, placement) = (base_dir.to_path_buf(), cfg.clone(), placement.clone());
        let group = tokio::task::spawn_blocking(move || start_group(&dir, &config, &placement))
            .await
            .map_err(|e| Error::stopped(format!("the task starting the ranks ({e})")))??;
        tracing::info!(ranks = group.world_size(), "training engine ready");
        let engine = Engine { group, base_dir: base_dir.to_path_buf(), cfg: cfg.clone() };
        if let Some(dir) = resume_from {
            let dir = dir.to_path_buf();
            engine
                .group
                .run_on_every_rank(move |_, policy, trainer| checkpoint_io::load(policy, trainer, &dir))
                .await?;
        }
        Ok(engine)
    }

    /// One synchronized optimizer step over the whole step's `batches`. When `cancel` fires,
    /// the ranks stop after their current micro-batch and the weights are left unchanged
    /// ([`Error::Cancelled`]).
    pub async fn train(&self, batches: Vec<MicroBatch>, cancel: &CancellationToken) -> Result<StepMetrics> {
        let result = self.group.train(batches, cancel.clone()).await;
        match result {
            Err(_) if cancel.is_cancelled() => Err(Error::Cancelled),
            other => other,
        }
    }

    /// Rank 0 writes the trainable weights and optimizer state to `dir`.
    pub async fn save(&self, dir: &Path) -> Result<CheckpointFormat> {
        let (dir, base) = (dir.to_path_buf(), self.base_dir.display().to_string());
        self.group.run_on_rank_zero(move |policy, trainer| checkpoint_io::save(policy, trainer, &dir, &base)).await
    }

    /// Every rank reloads the base model, then `dir`'s checkpoint (none: fresh adapters and
    /// optimizer, rank 0's on every rank, so that the replicas stay identical).
    pub async fn restore(&self, dir: Option<&Path>) -> Result<()> {
        let (base_dir, cfg, dir) = (self.base_dir.clone(), self.cfg.clone(), dir.map(Path::to_path_buf));
        self.group
            .run_on_every_replica(move |_, replica| {
                let device = replica.policy.device();
                let loaded = Policy::load_for_training(&base_dir, &cfg, device).and_then(|mut policy| {
                    let mut trainer = Trainer::new(&cfg, device);
                    if let Some(dir) = &dir {
                        checkpoint_io::load(&mut policy, &mut trainer, dir)?;
                    }
                    Ok((policy, trainer))
                });
                // All ranks learn whether any failed before the weight collective below, and a
                // rank that failed keeps its previous replica.
                let (policy, trainer) = agree_on_success(replica.collective.as_ref(), loaded)?;
                (replica.policy, replica.trainer) = (policy, trainer);
                match dir {
                    Some(_) => Ok(()),
                    None => replica.take_rank_zero_weights(),
                }
            })
            .await
    }
}

/// Blocks until every rank has loaded (NCCL waits for the whole group).
fn start_group(base_dir: &Path, cfg: &TrainConfig, placement: &Placement) -> Result<RankGroup> {
    let load_on = |device: Device| -> Result<(Policy, Trainer)> {
        Ok((Policy::load_for_training(base_dir, cfg, device)?, Trainer::new(cfg, device)))
    };
    match placement {
        Placement::One(device) => {
            let (policy, trainer) = load_on(*device)?;
            RankGroup::from_replicas(vec![RankReplica { policy, trainer, collective: Box::new(SingleRank) }])
        }
        Placement::Gpus(ordinals) => {
            let id = NcclUniqueId::new()?;
            RankGroup::start_nccl(base_dir, cfg, ordinals, id, 0, ordinals.len())
        }
        Placement::CpuRanks(count) => {
            let replicas = local_group(*count)
                .into_iter()
                .map(|collective| {
                    let (policy, trainer) = load_on(Device::Cpu)?;
                    Ok(RankReplica { policy, trainer, collective: Box::new(collective) })
                })
                .collect::<Result<Vec<_>>>()?;
            RankGroup::from_replicas(replicas)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_flag_counts_devices_and_refuses_what_is_not_there() {
        assert_eq!(Placement::from_gpus_flag("all", 4), Ok(Placement::Gpus(vec![0, 1, 2, 3])));
        assert_eq!(Placement::from_gpus_flag("2", 4), Ok(Placement::Gpus(vec![0, 1])));
        assert_eq!(Placement::from_gpus_flag("1", 4), Ok(Placement::One(Device::Cuda(0))));
        assert_eq!(Placement::from_gpus_flag("all", 1), Ok(Placement::One(Device::Cuda(0))));
        assert!(Placement::from_gpus_flag("8", 4).unwrap_err().contains("only 4"));
        assert!(Placement::from_gpus_flag("all", 0).unwrap_err().contains("no CUDA device"));
        assert!(Placement::from_gpus_flag("two", 4).unwrap_err().contains("expected"));
        assert_eq!(Placement::Gpus(vec![0, 1]).device_names(), vec!["cuda:0", "cuda:1"]);
        assert_eq!(Placement::CpuRanks(2).device_names(), vec!["cpu", "cpu"]);
    }
}
