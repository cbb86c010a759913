//! One synchronized data-parallel optimizer step, as seen by one rank of a [`Collective`].
//!
//! Every rank holds an identical replica and a share of the step's micro-batches (from
//! [`crate::collective::split_by_tokens`]). The step is exactly the single-rank [`Trainer::step`] on
//! the whole batch, reassembled from its parts:
//!
//! 1. the loss normalizer (trained tokens or sequences) is summed over ranks, so each rank divides
//!    its loss by the *global* count;
//! 2. each rank accumulates the gradients of its own micro-batches;
//! 3. the trainable variables' gradients are summed over ranks in buckets
//!    ([`all_reduce_gradients`]), so every rank now holds the gradient of the whole batch;
//! 4. every rank clips with the same global norm (computed after the all-reduce) and applies the
//!    same AdamW update, so the replicas stay identical without broadcasting weights;
//! 5. the loss parts and counts are summed over ranks in one small reduction, so every rank
//!    reports the metrics of the whole step.

use tch::{Kind, Tensor};

use super::{PolicyModel, StepMetrics, Trainer};
use crate::collective::{all_reduce_gradients, Collective, DEFAULT_BUCKET_ELEMENTS};
use crate::error::{Error, Result};
use crate::model::loss::LossOutput;
use crate::tokenize::MicroBatch;

/// Runs one optimizer step of this rank over its `batches` (possibly none), in lockstep with
/// the other ranks of `collective`. Every rank must call it once per step, in the same order;
/// every rank returns the same metrics (those of the whole step).
pub fn data_parallel_step(
    collective: &dyn Collective,
    trainer: &mut Trainer,
    model: &mut impl PolicyModel,
    batches: &[MicroBatch],
) -> Result<StepMetrics> {
    let rank = collective.rank();
    let normalizer = collective.all_reduce_scalar(trainer.normalizer(batches))?;
    if normalizer <= 0.0 {
        return Err(Error::Tokenize(format!(
            "the step has no trained tokens on any of {} ranks",
            collective.world_size()
        )));
    }
    let totals = agree_on_success(collective, trainer.accumulate_gradients(model, batches, normalizer))?;
    let params = model.trainable_variables();
    define_missing_gradients(&params)?;
    let mut grads: Vec<Tensor> = params.iter().map(Tensor::grad).collect();
    all_reduce_gradients(collective, &mut grads, DEFAULT_BUCKET_ELEMENTS)
        .map_err(|e| Error::Collective(format!("gradient all-reduce on rank {rank}: {e}")))?;
    // The norm (the same on every rank) and the summed metrics are read in one sync before the
    // update, so nothing waits for the AdamW kernels.
    let update = trainer.prepare_update(&params)?;
    let summed = sum_metrics(collective, &totals, batches, &update.norm)?;
    let grad_norm = summed.grad_norm;
    trainer.apply_update(update, grad_norm)?;
    let tokens = summed.tokens.max(1.0);
    Ok(StepMetrics {
        loss: summed.loss,
        policy_loss: summed.policy_loss,
        kl: summed.kl,
        grad_norm,
        lr: trainer.optimizer().learning_rate(),
        tokens: summed.tokens.round() as usize,
        sequences: summed.sequences.round() as usize,
        micro_batches: summed.micro_batches.round() as usize,
        clip_fraction: summed.clipped_tokens / tokens,
        mean_ratio: summed.ratio_sum / tokens,
    })
}

/// Every rank learns whether any rank failed its local work, so all of them abandon the step
/// together instead of the others blocking in the next collective. (A rank that panics or dies
/// still leaves its peers blocked: see docs/multi-gpu.md.)
pub fn agree_on_success<T>(collective: &dyn Collective, local: Result<T>) -> Result<T> {
    let failed_ranks = collective.all_reduce_scalar(if local.is_err() { 1.0 } else { 0.0 })?;
    match local {
        Ok(_) if failed_ranks > 0.0 => Err(Error::Collective(format!(
            "{failed_ranks} other rank(s) failed; rank {} gives up too",
            collective.rank()
        ))),
        local => local,
    }
}

/// Makes every rank's `tensors` equal to rank 0's (a sum where only rank 0 contributes), e.g.
/// the trainable weights of replicas whose LoRA adapters were initialized independently.
pub fn copy_from_rank_zero(collective: &dyn Collective, tensors: &[Tensor]) -> Result<()> {
    tch::no_grad(|| {
        for t in tensors {
            let mut value = if collective.rank() == 0 { t.detach().copy() } else { t.zeros_like() };
            collective.all_reduce_sum(&mut value)?;
            t.detach().copy_(&value);
        }
        Ok(())
    })
}

/// A rank with no micro-batches (or a variable no micro-batch reached) has no gradient yet;
/// gives each such variable a zero gradient so the all-reduce sees every variable on every rank.
fn define_missing_gradients(params: &[Tensor]) -> Result<()> {
    let zeros: Vec<Tensor> = params.iter().filter(|p| !p.grad().defined()).map(|p| p.sum(Kind::Float) * 0.0).collect();
    if zeros.is_empty() {
        return Ok(());
    }
    Tensor::stack(&zeros, 0).sum(Kind::Float).f_backward().map_err(Error::torch("define zero gradients"))
}

/// One step's loss parts and counts, summed over ranks.
#[derive(Debug, Clone, Copy, PartialEq)]
struct SummedMetrics {
    loss: f64,
    policy_loss: f64,
    kl: f64,
    clipped_tokens: f64,
    ratio_sum: f64,
    tokens: f64,
    sequences: f64,
    micro_batches: f64,
    /// Not summed: the global gradient norm, already the same on every rank.
    grad_norm: f64,
}

/// Sums this rank's loss parts and counts over ranks in one reduction, and reads them with
/// `grad_norm` (already global) in one host sync.
fn sum_metrics(
    collective: &dyn Collective,
    totals: &LossOutput,
    batches: &[MicroBatch],
    grad_norm: &Tensor,
) -> Result<SummedMetrics> {
    let device = totals.loss.device();
    let counts = Tensor::from_slice(&[
        batches.iter().map(MicroBatch::num_sequences).sum::<usize>() as f64,
        batches.len() as f64,
    ])
    .to_device(device);
    let parts =
        [&totals.loss, &totals.policy_loss, &totals.kl, &totals.clipped_tokens, &totals.ratio_sum, &totals.tokens];
    let mut local: Vec<Tensor> = parts.iter().map(|t| t.to_kind(Kind::Double).reshape([1])).collect();
    local.push(counts);
    let mut joined = Tensor::cat(&local, 0);
    collective.all_reduce_sum(&mut joined)?;
    let joined = Tensor::cat(&[joined, grad_norm.to_device(device).to_kind(Kind::Double).reshape([1])], 0);
    let v: Vec<f64> = Vec::try_from(joined.to_device(tch::Device::Cpu))
        .map_err(Error::torch(format!("read step metrics on rank {}", collective.rank())))?;
    Ok(SummedMetrics {
        loss: v[0],
        policy_loss: v[1],
        kl: v[2],
        clipped_tokens: v[3],
        ratio_sum: v[4],
        tokens: v[5],
        sequences: v[6],
        micro_batches: v[7],
        grad_norm: v[8],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::local_group;

    #[test]
    fn variables_without_a_gradient_get_a_zero_one() {
        let a = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        let b = Tensor::from_slice(&[3.0f32]).set_requires_grad(true);
        (&a * 2.0).sum(Kind::Float).backward();
        define_missing_gradients(&[a.shallow_clone(), b.shallow_clone()]).unwrap();
        assert_eq!(Vec::<f32>::try_from(a.grad()).unwrap(), vec![2.0, 2.0]);
        assert_eq!(Vec::<f32>::try_from(b.grad()).unwrap(), vec![0.0]);
    }

    #[test]
    fn one_failing_rank_makes_every_rank_abandon_the_step() {
        let handles: Vec<_> = local_group(3)
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let local = if c.rank() == 1 { Err(Error::Tokenize("bad batch".into())) } else { Ok(()) };
                    agree_on_success(&c, local).map_err(|e| e.to_string())
                })
            })
            .collect();
        let errors: Vec<String> = handles.into_iter().map(|h| h.join().unwrap().unwrap_err()).collect();
        assert!(errors[1].contains("bad batch") && errors[0].contains("1 other rank(s) failed"), "{errors:?}");
    }

    #[test]
    fn every_rank_ends_with_rank_zeros_values() {
        let handles: Vec<_> = local_group(3)
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let t = Tensor::from_slice(&[c.rank() as f32 + 1.0, 5.0]).set_requires_grad(true);
                    copy_from_rank_zero(&c, std::slice::from_ref(&t)).unwrap();
                    Vec::<f32>::try_from(t.detach()).unwrap()
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), vec![1.0, 5.0]);
        }
    }

    #[test]
    fn metrics_are_summed_over_ranks() {
        let handles: Vec<_> = local_group(2)
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let mut totals = LossOutput::zeros(tch::Device::Cpu);
                    totals.tokens += 10.0 * (c.rank() + 1) as f64;
                    totals.loss += 0.5;
                    let batches = vec![MicroBatch::default(); c.rank() + 1];
                    sum_metrics(&c, &totals, &batches, &Tensor::from(2.5f32)).unwrap()
                })
            })
            .collect();
        for h in handles {
            let m = h.join().unwrap();
            assert_eq!((m.tokens, m.loss, m.micro_batches, m.grad_norm), (30.0, 1.0, 3.0, 2.5));
        }
    }
}
