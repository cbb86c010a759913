//! Packing tokenized trajectories into micro-batches of rows `[B, L]` under a token budget.
//!
//! Trajectories (documents) are placed first-fit, longest first, into rows of at most
//! `max_row_len` tokens; rows are then grouped, longest first, into micro-batches whose padded
//! size `B × L` stays within `max_tokens_per_micro_batch`. A document is never split, so every
//! sequence-level quantity (GSPO ratio, sequence-mean weight) is computed inside one micro-batch.
//! Position ids restart at 0 for each document; the engine's attention uses this to stay causal
//! within a document. Padding is a document of its own with nothing trained.

use super::trajectory::TokenizedTrajectory;
use crate::error::{Error, Result};

/// Token id used for padding input and target positions (never trained).
pub const PAD_TOKEN_ID: i64 = 0;

/// One trajectory to pack, with its advantage.
#[derive(Debug, Clone, Copy)]
pub struct PackItem<'a> {
    /// The tokenized trajectory.
    pub trajectory: &'a TokenizedTrajectory,
    /// Its group-relative advantage.
    pub advantage: f32,
}

/// One forward/backward pass worth of data: `rows × cols` positions, row-major.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MicroBatch {
    /// B.
    pub rows: usize,
    /// L.
    pub cols: usize,
    /// Input token ids.
    pub input_ids: Vec<i64>,
    /// Position within the document, restarting at 0 per document.
    pub position_ids: Vec<i64>,
    /// The next token of the same document (padding id after a document's last token).
    pub targets: Vec<i64>,
    /// True where the target is an assistant/completion token to train on.
    pub loss_mask: Vec<bool>,
    /// Sampler log-prob of the target; NaN where the sampler sent none (ratio 1).
    pub sampler_logprobs: Vec<f32>,
    /// Advantage of the document the position belongs to (0 on padding).
    pub advantages: Vec<f32>,
    /// Document number within this micro-batch, `0..num_sequences`; −1 on padding.
    pub sequence_index: Vec<i64>,
    /// For each document number: its index in the slice given to [`pack`].
    pub trajectory_index: Vec<usize>,
}

impl MicroBatch {
    /// Number of documents packed here.
    pub fn num_sequences(&self) -> usize {
        self.trajectory_index.len()
    }

    /// Number of real (non-padding) token positions.
    pub fn real_tokens(&self) -> usize {
        self.sequence_index.iter().filter(|&&s| s >= 0).count()
    }

    /// Number of trained target positions.
    pub fn trained_tokens(&self) -> usize {
        self.loss_mask.iter().filter(|m| **m).count()
    }

    /// Number of documents with at least one trained target (the sequence-mean denominator).
    pub fn trained_sequences(&self) -> usize {
        let mut seen = vec![false; self.num_sequences()];
        for (m, s) in self.loss_mask.iter().zip(&self.sequence_index) {
            if *m && *s >= 0 {
                seen[*s as usize] = true;
            }
        }
        seen.iter().filter(|s| **s).count()
    }

    fn push_document(&mut self, item: &PackItem<'_>, trajectory_index: usize) {
        let t = item.trajectory;
        let seq = self.trajectory_index.len() as i64;
        self.trajectory_index.push(trajectory_index);
        for p in 0..t.len() {
            let next = p + 1;
            self.input_ids.push(t.ids[p]);
            self.position_ids.push(p as i64);
            self.targets.push(t.ids.get(next).copied().unwrap_or(PAD_TOKEN_ID));
            self.loss_mask.push(t.trained.get(next).copied().unwrap_or(false));
            self.sampler_logprobs.push(t.sampler_logprobs.get(next).copied().flatten().unwrap_or(f32::NAN));
            self.advantages.push(item.advantage);
            self.sequence_index.push(seq);
        }
    }

    fn push_padding(&mut self, count: usize) {
        self.input_ids.extend(std::iter::repeat_n(PAD_TOKEN_ID, count));
        self.position_ids.extend(0..count as i64);
        self.targets.extend(std::iter::repeat_n(PAD_TOKEN_ID, count));
        self.loss_mask.extend(std::iter::repeat_n(false, count));
        self.sampler_logprobs.extend(std::iter::repeat_n(f32::NAN, count));
        self.advantages.extend(std::iter::repeat_n(0.0, count));
        self.sequence_index.extend(std::iter::repeat_n(-1, count));
    }
}

/// Packs trajectories into micro-batches (see the module docs). Fails only when one trajectory
/// is longer than a row or the budget, which tokenization's `max_seq_len` check prevents.
pub fn pack(items: &[PackItem<'_>], max_tokens_per_micro_batch: usize, max_row_len: usize) -> Result<Vec<MicroBatch>> {
    let row_len = max_row_len.min(max_tokens_per_micro_batch);
    if let Some((i, item)) = items.iter().enumerate().find(|(_, it)| it.trajectory.len() > row_len) {
        return Err(Error::Tokenize(format!(
            "trajectory {i} has {} tokens, more than a packed row holds ({row_len})",
            item.trajectory.len()
        )));
    }
    let rows = fill_rows(items, row_len);
    let mut batches = Vec::new();
    let mut current: Vec<&Vec<usize>> = Vec::new();
    let mut current_cols = 0;
    for row in &rows {
        let len = row_tokens(items, row);
        let cols = current_cols.max(len);
        if !current.is_empty() && (current.len() + 1) * cols > max_tokens_per_micro_batch {
            batches.push(build_batch(items, &current, current_cols));
            current.clear();
        }
        current_cols = if current.is_empty() { len } else { current_cols.max(len) };
        current.push(row);
    }
    if !current.is_empty() {
        batches.push(build_batch(items, &current, current_cols));
    }
    Ok(batches)
}

/// First-fit decreasing: rows of trajectory indices, longest rows first.
fn fill_rows(items: &[PackItem<'_>], row_len: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(items[i].trajectory.len()));
    let mut rows: Vec<(usize, Vec<usize>)> = Vec::new();
    for i in order {
        let len = items[i].trajectory.len();
        match rows.iter_mut().find(|(used, _)| used + len <= row_len) {
            Some((used, members)) => {
                *used += len;
                members.push(i);
            }
            None => rows.push((len, vec![i])),
        }
    }
    rows.sort_by_key(|(used, _)| std::cmp::Reverse(*used));
    rows.into_iter().map(|(_, members)| members).collect()
}

fn row_tokens(items: &[PackItem<'_>], row: &[usize]) -> usize {
    row.iter().map(|&i| items[i].trajectory.len()).sum()
}

fn build_batch(items: &[PackItem<'_>], rows: &[&Vec<usize>], cols: usize) -> MicroBatch {
    let mut batch = MicroBatch { rows: rows.len(), cols, ..Default::default() };
    for row in rows {
        for &i in row.iter() {
            batch.push_document(&items[i], i);
        }
        batch.push_padding(cols - row_tokens(items, row));
    }
    batch
}

#[cfg(test)]
mod tests {
    use super::*;

    fn traj(ids: &[i64], trained_from: usize) -> TokenizedTrajectory {
        TokenizedTrajectory {
            ids: ids.to_vec(),
            trained: (0..ids.len()).map(|p| p >= trained_from).collect(),
            sampler_logprobs: (0..ids.len()).map(|p| (p >= trained_from).then_some(-(p as f32))).collect(),
        }
    }

    #[test]
    fn targets_masks_and_positions_follow_each_document() {
        let a = traj(&[10, 11, 12], 1);
        let b = traj(&[20, 21], 1);
        let batches =
            pack(&[PackItem { trajectory: &a, advantage: 0.5 }, PackItem { trajectory: &b, advantage: -1.0 }], 8, 8)
                .unwrap();
        assert_eq!(batches.len(), 1);
        let mb = &batches[0];
        assert_eq!((mb.rows, mb.cols), (1, 5));
        assert_eq!(mb.input_ids, vec![10, 11, 12, 20, 21]);
        assert_eq!(mb.position_ids, vec![0, 1, 2, 0, 1]);
        assert_eq!(mb.targets, vec![11, 12, PAD_TOKEN_ID, 21, PAD_TOKEN_ID]);
        assert_eq!(mb.loss_mask, vec![true, true, false, true, false]);
        assert_eq!(mb.advantages, vec![0.5, 0.5, 0.5, -1.0, -1.0]);
        assert_eq!(mb.sequence_index, vec![0, 0, 0, 1, 1]);
        assert_eq!(mb.sampler_logprobs[..2], [-1.0, -2.0]);
        assert!(mb.sampler_logprobs[2].is_nan());
        assert_eq!((mb.trained_tokens(), mb.trained_sequences()), (3, 2));
    }

    #[test]
    fn rows_are_padded_and_batches_respect_the_budget() {
        let trajs: Vec<TokenizedTrajectory> = [4, 3, 3, 2, 1].iter().map(|&n| traj(&vec![7; n], 0)).collect();
        let items: Vec<PackItem<'_>> = trajs.iter().map(|t| PackItem { trajectory: t, advantage: 1.0 }).collect();
        let batches = pack(&items, 8, 4).unwrap();
        let mut seen: Vec<usize> = batches.iter().flat_map(|b| b.trajectory_index.clone()).collect();
        seen.sort();
        assert_eq!(seen, vec![0, 1, 2, 3, 4], "every trajectory packed exactly once");
        for b in &batches {
            assert!(b.rows * b.cols <= 8);
            assert_eq!(b.input_ids.len(), b.rows * b.cols);
            let pad = b.sequence_index.iter().filter(|s| **s < 0).count();
            assert!(b.loss_mask.iter().zip(&b.sequence_index).all(|(m, s)| !*m || *s >= 0));
            assert_eq!(b.input_ids.len() - pad, b.trajectory_index.iter().map(|&i| trajs[i].len()).sum::<usize>());
        }
    }

    #[test]
    fn a_trajectory_longer_than_a_row_is_refused() {
        let t = traj(&[1, 2, 3], 0);
        assert!(pack(&[PackItem { trajectory: &t, advantage: 0.0 }], 8, 2).is_err());
    }
}
