//! The worker's training engine: one replica on one device, or data-parallel ranks (one per
//! GPU, or in-process CPU ranks for tests) — the step code sees the same three calls.

use std::path::Path;

use tch::Device;

use super::engine_thread::ThreadEngine;
use super::options::DataParallel;
use super::rank_engine::RankEngine;
use crate::checkpoint::CheckpointFormat;
use crate::config::TrainConfig;
use crate::error::Result;
use crate::tokenize::MicroBatch;
use crate::train::StepMetrics;

/// Train, save and restore, whichever engine runs them.
pub(crate) enum EngineHandle {
    /// One replica on its own thread.
    Single(ThreadEngine),
    /// Data-parallel ranks; rank 0 saves.
    Ranks(Box<RankEngine>),
}

impl EngineHandle {
    /// Loads the base model from `base_dir` (and the checkpoint in `resume_from`) onto `device`,
    /// or onto every rank of `parallel`. Returns once every replica is ready.
    pub(crate) async fn start(
        base_dir: &Path,
        cfg: &TrainConfig,
        device: Device,
        parallel: &DataParallel,
        resume_from: Option<&Path>,
    ) -> Result<EngineHandle> {
        Ok(match parallel {
            DataParallel::Off => {
                EngineHandle::Single(ThreadEngine::start(base_dir, cfg, device, resume_from).await?)
            }
            ranks => {
                EngineHandle::Ranks(Box::new(RankEngine::start(base_dir, cfg, ranks, resume_from).await?))
            }
        })
    }

    /// Runs one optimizer step over `batches` (split across ranks by size).
    pub(crate) async fn train(&self, batches: Vec<MicroBatch>) -> Result<StepMetrics> {
        match self {
            EngineHandle::Single(engine) => engine.train(batches).await,
            EngineHandle::Ranks(engine) => engine.train(batches).await,
        }
    }

    /// Writes the trainable weights and optimizer state to `dir` (rank 0's, all being equal).
    pub(crate) async fn save(&self, dir: &Path) -> Result<CheckpointFormat> {
        match self {
            EngineHandle::Single(engine) => engine.save(dir).await,
            EngineHandle::Ranks(engine) => engine.save(dir).await,
        }
    }

    /// Reloads the base model, then the checkpoint in `dir` (none: fresh adapters/optimizer).
    pub(crate) async fn restore(&self, dir: Option<&Path>) -> Result<()> {
        match self {
            EngineHandle::Single(engine) => engine.restore(dir).await,
            EngineHandle::Ranks(engine) => engine.restore(dir).await,
        }
    }
}
