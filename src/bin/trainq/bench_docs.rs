//! The documents `trainq bench train --packed` trains on: agent-like trajectory lengths drawn
//! log-uniformly from `[min, max]` tokens (seeded, so the peer gets the same list), packed into
//! micro-batches exactly as the worker packs them (`tokenize::pack`: first-fit decreasing rows
//! of at most `seq` tokens, at most `seq × micro` tokens per micro-batch).

use anyhow::{Context, Result};
use rand::{Rng, SeedableRng};
use serde_json::json;
use trainq_engine::tokenize::{pack, MicroBatch, PackItem, TokenizedTrajectory};

/// Lengths of one step's documents: drawn until they hold `budget` tokens (the last one is cut
/// to fit), each in `[min, max]` and at most `seq` (a row).
pub(crate) fn document_lengths(budget: i64, (min, max): (i64, i64), seq: i64, seed: u64) -> Vec<i64> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (lo, hi) = ((min.max(2) as f64).ln(), (max.max(min).max(2) as f64).ln());
    let mut lengths = Vec::new();
    let mut total = 0;
    while total < budget {
        let len = rng.gen_range(lo..=hi).exp().round() as i64;
        let len = len.clamp(2, seq).min(budget - total).max(2);
        lengths.push(len);
        total += len;
    }
    lengths
}

/// Random-token documents of `lengths` (every token but the first trained, advantages ±1
/// alternating, no sampler log-probs), packed as the worker packs them.
pub(crate) fn packed_batches(lengths: &[i64], seq: i64, micro: i64, vocab: i64, seed: u64) -> Result<Vec<MicroBatch>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed);
    let docs: Vec<TokenizedTrajectory> = lengths
        .iter()
        .map(|&len| TokenizedTrajectory {
            ids: (0..len).map(|_| rng.gen_range(0..vocab)).collect(),
            trained: (0..len).map(|p| p > 0).collect(),
            sampler_logprobs: vec![None; len as usize],
        })
        .collect();
    let items: Vec<PackItem<'_>> = docs
        .iter()
        .enumerate()
        .map(|(i, trajectory)| PackItem { trajectory, advantage: if i % 2 == 0 { 1.0 } else { -1.0 } })
        .collect();
    pack(&items, (seq * micro) as usize, seq as usize).context("pack the benchmark documents")
}

/// The JSON the peer reads (`ops/bench/hf_peft_train.py --docs FILE`).
pub(crate) fn docs_json(lengths: &[i64], seq: i64, micro: i64, (min, max): (i64, i64)) -> serde_json::Value {
    json!({"seq": seq, "micro": micro, "doc_min": min, "doc_max": max, "docs": lengths})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_fill_the_budget_within_bounds_and_repeat_with_the_seed() {
        let lengths = document_lengths(16_384, (300, 6000), 4096, 7);
        assert_eq!(lengths.iter().sum::<i64>(), 16_384);
        assert!(lengths[..lengths.len() - 1].iter().all(|&n| (300..=4096).contains(&n)), "{lengths:?}");
        assert_eq!(lengths, document_lengths(16_384, (300, 6000), 4096, 7));
        assert_ne!(lengths, document_lengths(16_384, (300, 6000), 4096, 8));
    }

    #[test]
    fn packed_batches_hold_every_document_token_once() {
        let lengths = document_lengths(8_192, (300, 6000), 2048, 3);
        let batches = packed_batches(&lengths, 2048, 2, 1000, 3).unwrap();
        let docs: usize = batches.iter().map(MicroBatch::num_sequences).sum();
        assert_eq!(docs, lengths.len());
        let real: usize = batches.iter().flat_map(|b| &b.sequence_index).filter(|&&s| s >= 0).count();
        assert_eq!(real as i64, lengths.iter().sum::<i64>());
        assert!(batches.iter().all(|b| b.rows * b.cols <= 4096 && b.cols <= 2048));
    }
}
