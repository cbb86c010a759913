//! The ranks of one host's data-parallel group: one OS thread per rank (per GPU), each owning
//! its own [`Policy`] replica, [`Trainer`] and [`Collective`] member, fed over a channel.
//!
//! [`RankGroup::train`] splits a step's micro-batches across the *global* world by padded size
//! ([`split_by_tokens`]), hands each local rank its share, lets every rank run
//! [`data_parallel_step`] in lockstep, and returns the step's metrics (identical on every rank;
//! the first local rank's are returned). Saving a checkpoint runs on the first local rank only
//! ([`RankGroup::run_on_rank_zero`]); restoring runs on every rank ([`RankGroup::run_on_every_rank`]).
//!
//! A host of a multi-node group holds ranks `first_rank .. first_rank + local ranks` of
//! `world_size`; every host must be given the same micro-batches in the same order.

use std::path::Path;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use tch::Device;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::data_parallel::agree_on_success;
use super::{copy_from_rank_zero, data_parallel_step, StepMetrics, Trainer};
use crate::collective::{split_by_tokens, Collective, NcclCollective, NcclUniqueId};
use crate::error::{Error, Result};
use crate::model::Policy;
use crate::tokenize::MicroBatch;
use trainq_queue::config::TrainConfig;

/// What one rank owns.
pub struct RankReplica {
    /// This rank's copy of the policy (identical on every rank).
    pub policy: Policy,
    /// This rank's optimizer (identical state on every rank).
    pub trainer: Trainer,
    /// This rank's member of the group.
    pub collective: Box<dyn Collective>,
}

/// Work run on a rank's thread with its replica.
type RankWork = Box<dyn FnOnce(&mut RankReplica) + Send>;

enum RankJob {
    Train(Vec<MicroBatch>, CancellationToken, oneshot::Sender<Result<StepMetrics>>),
    Run(RankWork),
}

struct RankThread {
    jobs: Option<mpsc::Sender<RankJob>>,
    thread: Option<JoinHandle<()>>,
}

/// The local ranks of a data-parallel group; dropping it stops every rank after its current job.
pub struct RankGroup {
    ranks: Vec<RankThread>,
    first_rank: usize,
    world_size: usize,
}

impl RankGroup {
    /// One rank per CUDA device in `ordinals`, as ranks `first_rank..` of `world_size`: each
    /// thread loads the base model from `base_dir` onto its GPU and joins NCCL group `id`
    /// (every rank of the world must call this; NCCL blocks until all have joined).
    pub fn start_nccl(
        base_dir: &Path,
        cfg: &TrainConfig,
        ordinals: &[usize],
        id: NcclUniqueId,
        first_rank: usize,
        world_size: usize,
    ) -> Result<RankGroup> {
        let (base_dir, cfg, ordinals) = (base_dir.to_path_buf(), cfg.clone(), ordinals.to_vec());
        let count = ordinals.len();
        Self::start(count, first_rank, world_size, move |local| {
            let ordinal = ordinals[local];
            let device = Device::Cuda(ordinal);
            let collective = NcclCollective::new(id, first_rank + local, world_size, ordinal)?;
            // Every rank learns whether any failed to load before the first weight collective,
            // so one rank out of memory fails the start everywhere instead of hanging the rest.
            let policy = agree_on_success(&collective, Policy::load_for_training(&base_dir, &cfg, device))?;
            Ok(RankReplica { policy, trainer: Trainer::new(&cfg, device), collective: Box::new(collective) })
        })
    }

    /// Starts `count` local ranks, `first_rank..` of `world_size`; rank thread `i` builds its
    /// replica with `load(i)` (concurrently, as NCCL requires). Returns once all are ready.
    pub fn start(
        count: usize,
        first_rank: usize,
        world_size: usize,
        load: impl Fn(usize) -> Result<RankReplica> + Send + Sync + 'static,
    ) -> Result<RankGroup> {
        let load = Arc::new(load);
        let mut ready = Vec::with_capacity(count);
        let mut ranks = Vec::with_capacity(count);
        for local in 0..count {
            let (ready_tx, ready_rx) = mpsc::channel::<Result<()>>();
            let load = Arc::clone(&load);
            ranks.push(spawn_rank(first_rank + local, move || {
                match load(local).and_then(same_weights_as_rank_zero) {
                    Ok(replica) => {
                        let _ = ready_tx.send(Ok(()));
                        Some(replica)
                    }
                    Err(err) => {
                        let _ = ready_tx.send(Err(err));
                        None
                    }
                }
            })?);
            ready.push(ready_rx);
        }
        let group = RankGroup { ranks, first_rank, world_size };
        for (local, rx) in ready.into_iter().enumerate() {
            rx.recv().map_err(|_| rank_gone(first_rank + local))??;
        }
        Ok(group)
    }

    /// A single-host group from replicas built by the caller (e.g. over
    /// [`crate::collective::local_group`] for CPU tests); replica `i` must hold rank `i`.
    pub fn from_replicas(replicas: Vec<RankReplica>) -> Result<RankGroup> {
        let world_size = replicas.len();
        for (rank, replica) in replicas.iter().enumerate() {
            let (held, of) = (replica.collective.rank(), replica.collective.world_size());
            if (held, of) != (rank, world_size) {
                let message = format!("replica {rank} holds rank {held} of {of}, expected rank {rank} of {world_size}");
                return Err(Error::Collective(message));
            }
        }
        let slots = Mutex::new(replicas.into_iter().map(Some).collect::<Vec<_>>());
        Self::start(world_size, 0, world_size, move |rank| {
            let taken = slots.lock().ok().and_then(|mut slots| slots[rank].take());
            taken.ok_or_else(|| rank_gone(rank))
        })
    }

    /// Number of ranks in the whole group (all hosts).
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// This host's share of `batches` for each local rank (the global split, sliced).
    pub fn local_shares(&self, batches: &[MicroBatch]) -> Vec<Vec<MicroBatch>> {
        let sizes: Vec<usize> = batches.iter().map(|b| b.rows * b.cols).collect();
        split_by_tokens(&sizes, self.world_size)
            .into_iter()
            .skip(self.first_rank)
            .take(self.ranks.len())
            .map(|indices| indices.into_iter().map(|i| batches[i].clone()).collect())
            .collect()
    }

    /// Runs one synchronized optimizer step over the whole step's `batches`; when `cancel`
    /// fires, every rank gives up after its current micro-batch (the weights stay as they were).
    pub async fn train(&self, batches: Vec<MicroBatch>, cancel: CancellationToken) -> Result<StepMetrics> {
        self.all_ranks_alive()?;
        let mut replies = Vec::with_capacity(self.ranks.len());
        for (local, share) in self.local_shares(&batches).into_iter().enumerate() {
            let (reply, answer) = oneshot::channel();
            self.send(local, RankJob::Train(share, cancel.clone(), reply))?;
            replies.push(answer);
        }
        let mut first = None;
        for (local, answer) in replies.into_iter().enumerate() {
            let metrics = answer.await.map_err(|_| rank_gone(self.first_rank + local))??;
            first.get_or_insert(metrics);
        }
        first.ok_or_else(|| Error::stopped("every rank (the group has none)"))
    }

    /// [`RankGroup::train`] for callers outside an async runtime.
    pub fn train_blocking(&self, batches: Vec<MicroBatch>) -> Result<StepMetrics> {
        futures::executor::block_on(self.train(batches, CancellationToken::new()))
    }

    /// Runs `work` on the first local rank's thread with its replica (rank 0 saves checkpoints).
    pub async fn run_on_rank_zero<T: Send + 'static>(
        &self,
        work: impl FnOnce(&mut Policy, &mut Trainer) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let (reply, answer) = oneshot::channel();
        self.send(
            0,
            RankJob::Run(Box::new(move |replica: &mut RankReplica| {
                let _ = reply.send(work(&mut replica.policy, &mut replica.trainer));
            })),
        )?;
        answer.await.map_err(|_| rank_gone(self.first_rank))?
    }

    /// [`RankGroup::run_on_rank_zero`] for callers outside an async runtime.
    pub fn run_on_rank_zero_blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce(&mut Policy, &mut Trainer) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        futures::executor::block_on(self.run_on_rank_zero(work))
    }

    /// Runs `work(rank, policy, trainer)` on every local rank (e.g. loading a checkpoint into
    /// every replica); returns the first error.
    pub async fn run_on_every_rank(
        &self,
        work: impl Fn(usize, &mut Policy, &mut Trainer) -> Result<()> + Send + Sync + 'static,
    ) -> Result<()> {
        self.run_on_every_replica(move |rank, replica| work(rank, &mut replica.policy, &mut replica.trainer)).await
    }

    /// Runs `work(rank, replica)` on every local rank at once, with the rank's collective too
    /// (work that reduces across ranks, such as [`RankReplica::take_rank_zero_weights`] after
    /// reloading every replica); waits for all of them and returns the first error.
    pub async fn run_on_every_replica(
        &self,
        work: impl Fn(usize, &mut RankReplica) -> Result<()> + Send + Sync + 'static,
    ) -> Result<()> {
        self.all_ranks_alive()?;
        let work = Arc::new(work);
        let mut replies = Vec::with_capacity(self.ranks.len());
        for local in 0..self.ranks.len() {
            let (reply, answer) = oneshot::channel();
            let (work, rank) = (Arc::clone(&work), self.first_rank + local);
            self.send(
                local,
                RankJob::Run(Box::new(move |replica: &mut RankReplica| {
                    let _ = reply.send(work(rank, replica));
                })),
            )?;
            replies.push(answer);
        }
        let mut first_error = None;
        for (local, answer) in replies.into_iter().enumerate() {
            if let Err(err) = answer.await.map_err(|_| rank_gone(self.first_rank + local)).and_then(|r| r) {
                first_error.get_or_insert(err);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// An error naming the first local rank whose thread has ended, if any: collective work must
    /// not be handed to some ranks when another can no longer take part.
    fn all_ranks_alive(&self) -> Result<()> {
        for (local, rank) in self.ranks.iter().enumerate() {
            if rank.jobs.is_none() || rank.thread.as_ref().is_none_or(JoinHandle::is_finished) {
                return Err(rank_gone(self.first_rank + local));
            }
        }
        Ok(())
    }

    fn send(&self, local: usize, job: RankJob) -> Result<()> {
        let jobs =
            self.ranks.get(local).and_then(|r| r.jobs.as_ref()).ok_or_else(|| rank_gone(self.first_rank + local))?;
        jobs.send(job).map_err(|_| rank_gone(self.first_rank + local))
    }
}

/// Spawns rank `rank`'s thread: it builds its replica with `load` (None: failed, the thread
/// ends) and then answers jobs until the channel closes.
fn spawn_rank(rank: usize, load: impl FnOnce() -> Option<RankReplica> + Send + 'static) -> Result<RankThread> {
    let (jobs, inbox) = mpsc::channel::<RankJob>();
    let thread = std::thread::Builder::new()
        .name(format!("trainq-rank-{rank}"))
        .spawn(move || {
            let Some(mut replica) = load() else { return };
            for job in inbox {
                match job {
                    RankJob::Train(batches, cancel, reply) => {
                        let RankReplica { policy, trainer, collective } = &mut replica;
                        trainer.set_cancel(Some(cancel));
                        let _ = reply.send(data_parallel_step(collective.as_ref(), trainer, policy, &batches));
                        trainer.set_cancel(None);
                    }
                    RankJob::Run(work) => work(&mut replica),
                }
            }
        })
        .map_err(Error::io(format!("spawn the thread of rank {rank}")))?;
    Ok(RankThread { jobs: Some(jobs), thread: Some(thread) })
}

impl Drop for RankThread {
    fn drop(&mut self) {
        drop(self.jobs.take()); // closes the channel: the thread ends after its current job
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl RankReplica {
    /// Overwrites this replica's trainable weights with rank 0's (every rank must call it at
    /// once: it is an all-reduce). Every rank does this before its first step, so replicas are
    /// equal whatever their loaders did.
    pub fn take_rank_zero_weights(&self) -> Result<()> {
        copy_from_rank_zero(self.collective.as_ref(), &self.policy.trainable_variables())
    }
}

fn same_weights_as_rank_zero(replica: RankReplica) -> Result<RankReplica> {
    replica.take_rank_zero_weights()?;
    Ok(replica)
}

fn rank_gone(rank: usize) -> Error {
    Error::stopped(format!("the thread of rank {rank}"))
}
