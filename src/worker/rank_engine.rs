//! The data-parallel engine of `trainq worker --gpus N`: a [`RankGroup`] of one rank per GPU
//! (NCCL through cudarc), or of in-process CPU ranks ([`DataParallel::CpuRanks`], for tests).
//! Every rank holds a replica; rank 0 alone writes checkpoints; restoring reloads every replica.

use std::path::{Path, PathBuf};

use tch::Device;

use super::options::DataParallel;
use super::weights_io;
use crate::checkpoint::CheckpointFormat;
use crate::config::TrainConfig;
use crate::dist::{local_group, NcclUniqueId};
use crate::error::{Error, Result};
use crate::model::Policy;
use crate::tokenize::MicroBatch;
use crate::train::{agree_on_success, RankGroup, RankReplica, StepMetrics, Trainer};

/// The ranks of this host and what reloading a replica needs.
pub(crate) struct RankEngine {
    group: RankGroup,
    base_dir: PathBuf,
    cfg: TrainConfig,
}

impl RankEngine {
    /// Starts one rank per entry of `parallel` (every rank loads the base model and takes rank
    /// 0's adapters), then loads `resume_from` into every replica.
    pub(crate) async fn start(
        base_dir: &Path,
        cfg: &TrainConfig,
        parallel: &DataParallel,
        resume_from: Option<&Path>,
    ) -> Result<RankEngine> {
        let (dir, config, parallel) = (base_dir.to_path_buf(), cfg.clone(), parallel.clone());
        let group = tokio::task::spawn_blocking(move || start_group(&dir, &config, &parallel))
            .await
            .map_err(|e| Error::Engine(format!("starting the ranks panicked: {e}")))??;
        tracing::info!(ranks = group.world_size(), "data-parallel ranks ready");
        let engine = RankEngine {
            group,
            base_dir: base_dir.to_path_buf(),
            cfg: cfg.clone(),
        };
        if let Some(dir) = resume_from {
            let dir = dir.to_path_buf();
            engine
                .group
                .run_on_every_rank(move |_, policy, trainer| {
                    weights_io::load(policy, trainer, &dir)
                })
                .await?;
        }
        Ok(engine)
    }

    /// One synchronized optimizer step over the whole step's `batches`.
    pub(crate) async fn train(&self, batches: Vec<MicroBatch>) -> Result<StepMetrics> {
        self.group.train(batches).await
    }

    /// Rank 0 writes the checkpoint (every replica holds the same weights and moments).
    pub(crate) async fn save(&self, dir: &Path) -> Result<CheckpointFormat> {
        let (dir, base) = (dir.to_path_buf(), self.base_dir.display().to_string());
        self.group
            .run_on_rank_zero(move |policy, trainer| weights_io::save(policy, trainer, &dir, &base))
            .await
    }

    /// Every rank reloads the base model and `dir`'s checkpoint (or fresh adapters, then rank
    /// 0's, so that the replicas stay identical).
    pub(crate) async fn restore(&self, dir: Option<&Path>) -> Result<()> {
        let (base_dir, cfg, dir) = (
            self.base_dir.clone(),
            self.cfg.clone(),
            dir.map(Path::to_path_buf),
        );
        self.group
            .run_on_every_replica(move |_, replica| {
                let device = replica.policy.device();
                let loaded = Policy::load(&base_dir, cfg.lora.as_ref(), device).and_then(|mut policy| {
                    let mut trainer = Trainer::new(&cfg, device);
                    if let Some(dir) = &dir {
                        weights_io::load(&mut policy, &mut trainer, dir)?;
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
fn start_group(base_dir: &Path, cfg: &TrainConfig, parallel: &DataParallel) -> Result<RankGroup> {
    match parallel {
        DataParallel::Gpus(ordinals) => {
            let id = NcclUniqueId::new()?;
            RankGroup::start_nccl(base_dir, cfg, ordinals, id, 0, ordinals.len())
        }
        DataParallel::CpuRanks(count) => {
            let replicas = local_group(*count)
                .into_iter()
                .map(|collective| {
                    let policy = Policy::load(base_dir, cfg.lora.as_ref(), Device::Cpu)?;
                    Ok(RankReplica {
                        policy,
                        trainer: Trainer::new(cfg, Device::Cpu),
                        collective: Box::new(collective),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            RankGroup::from_replicas(replicas)
        }
        DataParallel::Off => Err(Error::Engine(
            "a rank group needs --gpus N (N > 1) or CPU ranks".into(),
        )),
    }
}
