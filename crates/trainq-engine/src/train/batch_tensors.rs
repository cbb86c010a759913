//! A packed micro-batch as tensors on a device: the engine's inputs and the loss's per-token data.

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::model::offload::upload;
use crate::model::BatchSummary;
use crate::tokenize::MicroBatch;

/// [`MicroBatch`] as tensors: id/position/target/index tensors are i64 `[B, L]`, the mask is
/// bool `[B, L]`, sampler log-probs and advantages are f32 `[B, L]` (NaN = no sampler log-prob).
#[derive(Debug)]
pub struct MicroBatchTensors {
    /// Input token ids.
    pub input_ids: Tensor,
    /// Position within each packed document.
    pub position_ids: Tensor,
    /// Next-token targets.
    pub targets: Tensor,
    /// Trained target positions.
    pub loss_mask: Tensor,
    /// Sampler log-probs of the targets.
    pub sampler_logprobs: Tensor,
    /// Per-position advantage.
    pub advantages: Tensor,
    /// Document number within the micro-batch (−1 on padding).
    pub sequence_index: Tensor,
    /// Number of documents.
    pub num_sequences: i64,
    /// Id range and packedness, read on the host (the forward then needs no device sync).
    pub summary: BatchSummary,
}

/// Copies a micro-batch to `device`.
pub fn to_tensors(batch: &MicroBatch, device: Device) -> Result<MicroBatchTensors> {
    let shape = [batch.rows as i64, batch.cols as i64];
    let expected = batch.rows * batch.cols;
    let lengths = [
        batch.input_ids.len(),
        batch.position_ids.len(),
        batch.targets.len(),
        batch.loss_mask.len(),
        batch.sampler_logprobs.len(),
        batch.advantages.len(),
        batch.sequence_index.len(),
    ];
    if lengths.iter().any(|&n| n != expected) {
        return Err(Error::Tokenize(format!(
            "micro-batch of {}x{} has field lengths {lengths:?}",
            batch.rows, batch.cols
        )));
    }
    // Pinned and asynchronous on CUDA (`model::offload::upload`): a pageable copy would wait
    // for everything queued, the previous step's AdamW update included, before each field.
    let to = |t: Tensor| upload(&t.reshape(shape), device).map_err(Error::torch("copy a micro-batch to the device"));
    Ok(MicroBatchTensors {
        input_ids: to(Tensor::from_slice(&batch.input_ids))?,
        position_ids: to(Tensor::from_slice(&batch.position_ids))?,
        targets: to(Tensor::from_slice(&batch.targets))?,
        loss_mask: to(Tensor::from_slice(&batch.loss_mask).to_kind(Kind::Bool))?,
        sampler_logprobs: to(Tensor::from_slice(&batch.sampler_logprobs))?,
        advantages: to(Tensor::from_slice(&batch.advantages))?,
        sequence_index: to(Tensor::from_slice(&batch.sequence_index))?,
        num_sequences: batch.num_sequences().max(1) as i64,
        summary: BatchSummary::of(&batch.input_ids, &batch.position_ids, &batch.targets, batch.cols),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenize::{pack, PackItem, TokenizedTrajectory};

    #[test]
    fn tensors_have_the_batch_shape_and_values() {
        let t = TokenizedTrajectory {
            ids: vec![5, 6, 7],
            trained: vec![false, true, true],
            sampler_logprobs: vec![None, Some(-0.5), None],
        };
        let batches = pack(&[PackItem { trajectory: &t, advantage: 2.0 }], 16, 16).unwrap();
        let tensors = to_tensors(&batches[0], Device::Cpu).unwrap();
        assert_eq!(tensors.input_ids.size(), vec![1, 3]);
        assert_eq!(Vec::<i64>::try_from(tensors.targets.flatten(0, -1)).unwrap(), vec![6, 7, 0]);
        assert_eq!(Vec::<bool>::try_from(tensors.loss_mask.flatten(0, -1)).unwrap(), vec![true, true, false]);
        assert_eq!(tensors.sampler_logprobs.double_value(&[0, 0]), -0.5);
        assert!(tensors.sampler_logprobs.double_value(&[0, 1]).is_nan());
        assert_eq!(tensors.num_sequences, 1);
    }
}
