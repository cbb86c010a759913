//! From claimed groups to micro-batches: filter (with a reason per skipped group), tokenize
//! (too long or unusable groups are skipped too, or their long trajectories cut or masked),
//! compute advantages (optionally leaving zero-advantage trajectories out) and pack.
//!
//! Everything a group can get wrong is decided here, group by group: a group whose stored JSON
//! did not decode, that does not render, or whose token ids lie outside the model's vocabulary
//! is skipped `invalid` with the reason, and its batch-mates train as if it were not there.

use crate::error::Result;
use trainq_engine::tokenize::{
    pack, ChatTokenizer, MicroBatch, PackItem, TokenizeError, TokenizedTrajectory, Trajectory,
};
use trainq_queue::config::{TooLongPolicy, TrainConfig, UnknownPolicyVersion};
use trainq_queue::db::claims::ClaimedGroup;
use trainq_queue::rl::{advantages, filter_groups, mean, population_std, FilterParams, FilterReport, SkipReason};
use trainq_queue::StepNumber;

/// A step's training input and what the step record says about it.
#[derive(Debug)]
pub(crate) struct PreparedStep {
    /// Kept and skipped groups, with reasons.
    pub report: FilterReport,
    /// Packed micro-batches of the kept groups (empty when nothing is kept).
    pub batches: Vec<MicroBatch>,
    /// (rewards, policy_version) of each kept group, for the step record.
    pub trained: Vec<(Vec<f64>, Option<StepNumber>)>,
    /// Trajectories in the batches.
    pub trajectories: usize,
    /// Trained (assistant) tokens in the batches.
    pub tokens: usize,
    /// Trained tokens that carry the sampler's log-prob (the rest train with ratio 1).
    pub logprob_tokens: usize,
    /// Trajectories of kept groups that were cut or left out of the loss, and why.
    pub left_out: LeftOut,
}

/// Trajectories of kept groups that did not train whole.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct LeftOut {
    /// Cut to `max_seq_len` tokens (`too_long = "truncate"`).
    pub truncated: usize,
    /// Longer than `max_seq_len` and left out of the loss (`too_long = "mask"`).
    pub masked: usize,
    /// Zero advantage in a group with variance (`advantages.drop_zero_advantage_trajectories`).
    pub zero_advantage: usize,
}

/// A kept group's tokenized trajectories, in order; `None` where one is left out of the loss.
type Tokenized = Vec<Option<TokenizedTrajectory>>;

/// Filters, tokenizes and packs `groups` for a step that starts from `current_step`; token ids
/// must lie below `vocab_size` (the base model's, when known).
pub(crate) fn prepare_step(
    groups: &[ClaimedGroup],
    cfg: &TrainConfig,
    current_step: StepNumber,
    tokenizer: &ChatTokenizer,
    vocab_size: Option<i64>,
) -> Result<PreparedStep> {
    let params = FilterParams {
        zero_variance_tolerance: cfg.advantages.zero_variance_tolerance,
        current_step,
        accepted_staleness: cfg.accepted_staleness(),
        accept_unknown_policy_version: cfg.queue.unknown_policy_version == UnknownPolicyVersion::Accept,
    };
    let rewards: Vec<_> = groups.iter().map(ClaimedGroup::to_group_rewards).collect();
    let mut report = filter_groups(&rewards, &params);
    let mut left_out = LeftOut::default();

    let mut kept: Vec<(&ClaimedGroup, Vec<f64>, Tokenized)> = Vec::new();
    let to_tokenize: Vec<&ClaimedGroup> = groups.iter().filter(|g| report.kept.contains(&g.id)).collect();
    let tokenized_groups = map_in_parallel(&to_tokenize, |group| {
        tokenize_group(group, tokenizer, cfg.max_seq_len, cfg.too_long)
            .and_then(|t| require_vocabulary(t, vocab_size))
            .and_then(|t| require_logprobs(t, cfg.loss.allow_training_without_logprobs))
    });
    for (group, tokenized) in to_tokenize.into_iter().zip(tokenized_groups) {
        let group_rewards = group.rewards();
        match tokenized {
            Ok((tokenized, cut)) => {
                left_out.truncated += cut;
                left_out.masked += tokenized.iter().filter(|t| t.is_none()).count();
                kept.push((group, group_rewards, tokenized));
            }
            Err((reason, detail)) => {
                report.mark_skipped(group.id, reason, Some(population_std(&group_rewards)), Some(detail));
            }
        }
    }

    let tolerance = cfg.advantages.zero_variance_tolerance;
    let mut items: Vec<PackItem<'_>> = Vec::new();
    for (_, group_rewards, trajectories) in &kept {
        let advs = advantages(group_rewards, cfg.advantages.scale_rewards);
        let group_mean = mean(group_rewards);
        for ((t, a), r) in trajectories.iter().zip(advs).zip(group_rewards) {
            let Some(trajectory) = t else { continue };
            if cfg.advantages.drop_zero_advantage_trajectories && (r - group_mean).abs() <= tolerance {
                left_out.zero_advantage += 1;
                continue;
            }
            items.push(PackItem { trajectory, advantage: a as f32 });
        }
    }
    let batches =
        if items.is_empty() { Vec::new() } else { pack(&items, cfg.max_tokens_per_micro_batch, cfg.max_seq_len)? };
    Ok(PreparedStep {
        trajectories: items.len(),
        tokens: items.iter().map(|i| i.trajectory.trained_tokens()).sum(),
        logprob_tokens: items.iter().map(|i| logprob_tokens(i.trajectory)).sum(),
        trained: kept.iter().map(|(g, r, _)| (r.clone(), g.policy_version)).collect(),
        report,
        batches,
        left_out,
    })
}

/// `f` over `items` on up to one thread per core, results in the items' order: tokenizing a
/// step's groups is CPU work that would otherwise sit between two training steps.
fn map_in_parallel<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(items.len());
    if threads <= 1 {
        return items.iter().map(f).collect();
    }
    let chunk = items.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let f = &f;
        let workers: Vec<_> =
            items.chunks(chunk).map(|part| scope.spawn(move || part.iter().map(f).collect::<Vec<R>>())).collect();
        workers.into_iter().flat_map(|w| w.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))).collect()
    })
}

/// Tokenizes every trajectory of a group and applies `too_long` to the ones over `max_seq_len`;
/// returns them with the number cut. The first failure decides the group's skip reason.
fn tokenize_group(
    group: &ClaimedGroup,
    tokenizer: &ChatTokenizer,
    max_seq_len: usize,
    too_long: TooLongPolicy,
) -> std::result::Result<(Tokenized, usize), (SkipReason, String)> {
    let items = group.trajectories.as_array().map(Vec::as_slice).unwrap_or_default();
    // Only a group-skipping policy needs the tokenizer to refuse long trajectories.
    let limit = if too_long == TooLongPolicy::SkipGroup { max_seq_len } else { usize::MAX };
    let mut cut = 0;
    let mut out = Vec::with_capacity(items.len());
    for (i, value) in items.iter().enumerate() {
        let mut t = Trajectory::from_json(value).and_then(|t| tokenizer.tokenize(&t, limit)).map_err(|e| match e {
            TokenizeError::TooLong { .. } => (SkipReason::TooLong, format!("trajectory {i}: {e}")),
            TokenizeError::Invalid(_) => (SkipReason::Invalid, format!("trajectory {i}: {e}")),
        })?;
        if t.len() <= max_seq_len {
            out.push(Some(t));
        } else if too_long == TooLongPolicy::Truncate {
            t.truncate(max_seq_len);
            cut += 1;
            out.push(Some(t));
        } else {
            out.push(None);
        }
    }
    if !out.is_empty() && out.iter().all(Option::is_none) {
        let detail = format!("every trajectory is longer than max_seq_len {max_seq_len} (too_long = \"mask\")");
        return Err((SkipReason::TooLong, detail));
    }
    Ok((out, cut))
}

/// Trained tokens of `t` that carry the sampler's log-prob.
fn logprob_tokens(t: &TokenizedTrajectory) -> usize {
    t.trained.iter().zip(&t.sampler_logprobs).filter(|(trained, lp)| **trained && lp.is_some()).count()
}

/// Refuses (as `invalid`) a group with a token id outside `[0, vocab_size)`: the embedding has
/// no row for it, and the whole step would fail on it.
fn require_vocabulary(
    (tokenized, cut): (Tokenized, usize),
    vocab_size: Option<i64>,
) -> std::result::Result<(Tokenized, usize), (SkipReason, String)> {
    let Some(vocab) = vocab_size else { return Ok((tokenized, cut)) };
    for (i, t) in tokenized.iter().enumerate() {
        let Some(t) = t else { continue };
        if let Some((at, id)) = t.ids.iter().enumerate().find(|(_, id)| **id < 0 || **id >= vocab) {
            let detail = format!(
                "trajectory {i}: token id {id} at position {at} is outside the model's vocabulary [0, {vocab})"
            );
            return Err((SkipReason::Invalid, detail));
        }
    }
    Ok((tokenized, cut))
}

/// Refuses (as `invalid`) a group with a trajectory whose trained tokens carry no sampler log-prob
/// at all, unless `loss.allow_training_without_logprobs`: without them the importance ratio is 1
/// and off-policy samples would be trained as if on-policy.
fn require_logprobs(
    (tokenized, cut): (Tokenized, usize),
    allowed: bool,
) -> std::result::Result<(Tokenized, usize), (SkipReason, String)> {
    if allowed {
        return Ok((tokenized, cut));
    }
    let lacking =
        |t: &Option<TokenizedTrajectory>| t.as_ref().is_some_and(|t| t.trained_tokens() > 0 && logprob_tokens(t) == 0);
    match tokenized.iter().position(lacking) {
        Some(i) => Err((
            SkipReason::Invalid,
            format!(
                "trajectory {i}: no sampler log-probs on its trained tokens (send \"logprobs\", or set \
                 loss.allow_training_without_logprobs = true to train it with importance ratio 1)"
            ),
        )),
        None => Ok((tokenized, cut)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_map_keeps_the_items_order_whatever_the_thread_count() {
        for n in [0, 1, 2, 7, 33] {
            let items: Vec<usize> = (0..n).collect();
            assert_eq!(map_in_parallel(&items, |i| i * 10), items.iter().map(|i| i * 10).collect::<Vec<_>>());
        }
    }

    fn tokenized(ids: Vec<i64>) -> Option<TokenizedTrajectory> {
        let n = ids.len();
        Some(TokenizedTrajectory { ids, trained: vec![true; n], sampler_logprobs: vec![None; n] })
    }

    #[test]
    fn a_token_id_outside_the_vocabulary_makes_the_group_invalid() {
        let group = vec![tokenized(vec![1, 2, 3]), None, tokenized(vec![4, 8])];
        assert!(require_vocabulary((group.clone(), 0), Some(9)).is_ok());
        assert!(require_vocabulary((group.clone(), 0), None).is_ok(), "unknown vocabulary: not checked");
        let (reason, detail) = require_vocabulary((group, 0), Some(8)).unwrap_err();
        assert_eq!(reason, SkipReason::Invalid);
        assert_eq!(detail, "trajectory 2: token id 8 at position 1 is outside the model's vocabulary [0, 8)");
    }
}
