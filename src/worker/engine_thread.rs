//! The single-device training engine on its own OS thread: it owns the policy, the optimizer and the device,
//! and answers jobs over a channel, so the async runtime (heartbeats, LISTEN) keeps running
//! while a step trains.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;

use tch::Device;
use tokio::sync::oneshot;

use crate::checkpoint::CheckpointFormat;
use crate::config::TrainConfig;
use crate::error::{Error, Result};
use crate::model::Policy;
use crate::tokenize::MicroBatch;
use crate::train::{StepMetrics, Trainer};

use super::weights_io;

enum Job {
    Train(Vec<MicroBatch>, oneshot::Sender<Result<StepMetrics>>),
    Save(PathBuf, oneshot::Sender<Result<CheckpointFormat>>),
    Restore(Option<PathBuf>, oneshot::Sender<Result<()>>),
}

/// Handle to the engine thread; dropping it stops the thread after its current job.
pub(crate) struct ThreadEngine {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

struct Engine {
    base_dir: PathBuf,
    cfg: TrainConfig,
    device: Device,
    policy: Policy,
    trainer: Trainer,
}

impl Engine {
    fn load(base_dir: &Path, cfg: &TrainConfig, device: Device) -> Result<Engine> {
        let policy = Policy::load(base_dir, cfg.lora.as_ref(), device)?;
        let trainer = Trainer::new(cfg, device);
        Ok(Engine { base_dir: base_dir.to_path_buf(), cfg: cfg.clone(), device, policy, trainer })
    }

    fn handle(&mut self, job: Job) {
        match job {
            Job::Train(batches, reply) => {
                let _ = reply.send(self.trainer.step(&mut self.policy, &batches));
            }
            Job::Save(dir, reply) => {
                let _ = reply.send(weights_io::save(&self.policy, &self.trainer, &dir, &self.base_dir.display().to_string()));
            }
            Job::Restore(dir, reply) => {
                let _ = reply.send(self.restore(dir.as_deref()));
            }
        }
    }

    /// Back to the base weights (fresh adapters, fresh optimizer) or to a saved checkpoint.
    fn restore(&mut self, dir: Option<&Path>) -> Result<()> {
        *self = Engine::load(&self.base_dir, &self.cfg, self.device)?;
        match dir {
            Some(dir) => weights_io::load(&mut self.policy, &mut self.trainer, dir),
            None => Ok(()),
        }
    }
}

impl ThreadEngine {
    /// Starts the thread and loads the base model from `base_dir` onto `device`, then the
    /// checkpoint in `resume_from` when given. Returns once the model is ready.
    pub(crate) async fn start(
        base_dir: &Path,
        cfg: &TrainConfig,
        device: Device,
        resume_from: Option<&Path>,
    ) -> Result<ThreadEngine> {
        let (jobs, inbox) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = oneshot::channel::<Result<()>>();
        let (base_dir, cfg, resume) = (base_dir.to_path_buf(), cfg.clone(), resume_from.map(Path::to_path_buf));
        let thread = std::thread::Builder::new()
            .name("trainq-engine".into())
            .spawn(move || {
                let mut engine = match Engine::load(&base_dir, &cfg, device) {
                    Ok(engine) => engine,
                    Err(err) => {
                        let _ = ready_tx.send(Err(err));
                        return;
                    }
                };
                let resumed = match &resume {
                    Some(dir) => weights_io::load(&mut engine.policy, &mut engine.trainer, dir),
                    None => Ok(()),
                };
                let failed = resumed.is_err();
                let _ = ready_tx.send(resumed);
                if failed {
                    return;
                }
                for job in inbox {
                    engine.handle(job);
                }
            })
            .map_err(Error::io("spawn the engine thread"))?;
        let handle = ThreadEngine { jobs: Some(jobs), thread: Some(thread) };
        ready_rx.await.map_err(|_| engine_gone())??;
        Ok(handle)
    }

    /// Runs one optimizer step over `batches`.
    pub(crate) async fn train(&self, batches: Vec<MicroBatch>) -> Result<StepMetrics> {
        self.ask(|reply| Job::Train(batches, reply)).await
    }

    /// Writes the trainable weights (PEFT adapter or HF model) and optimizer state to `dir`.
    pub(crate) async fn save(&self, dir: &Path) -> Result<CheckpointFormat> {
        self.ask(|reply| Job::Save(dir.to_path_buf(), reply)).await
    }

    /// Reloads the base model, then the checkpoint in `dir` (none: fresh adapters/optimizer).
    pub(crate) async fn restore(&self, dir: Option<&Path>) -> Result<()> {
        self.ask(|reply| Job::Restore(dir.map(Path::to_path_buf), reply)).await
    }

    async fn ask<T>(&self, job: impl FnOnce(oneshot::Sender<Result<T>>) -> Job) -> Result<T> {
        let (reply, answer) = oneshot::channel();
        let jobs = self.jobs.as_ref().ok_or_else(engine_gone)?;
        jobs.send(job(reply)).map_err(|_| engine_gone())?;
        answer.await.map_err(|_| engine_gone())?
    }
}

impl Drop for ThreadEngine {
    fn drop(&mut self) {
        drop(self.jobs.take()); // closes the channel: the thread ends after its current job
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn engine_gone() -> Error {
    Error::Engine("the engine thread stopped (it panicked or failed to load)".into())
}
