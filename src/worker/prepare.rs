//! From claimed groups to micro-batches: filter (with a reason per skipped group), tokenize
//! (too long or unusable groups are skipped too), compute advantages and pack.

use crate::error::Result;
use trainq_engine::tokenize::{
    pack, ChatTokenizer, MicroBatch, PackItem, TokenizeError, TokenizedTrajectory, Trajectory,
};
use trainq_queue::config::{TrainConfig, UnknownPolicyVersion};
use trainq_queue::db::claims::ClaimedGroup;
use trainq_queue::rl::{advantages, filter_groups, population_std, FilterParams, FilterReport, SkipReason};

/// A step's training input and what the step record says about it.
#[derive(Debug)]
pub(crate) struct PreparedStep {
    /// Kept and skipped groups, with reasons.
    pub report: FilterReport,
    /// Packed micro-batches of the kept groups (empty when nothing is kept).
    pub batches: Vec<MicroBatch>,
    /// (rewards, policy_version) of each kept group, for the step record.
    pub trained: Vec<(Vec<f64>, Option<i64>)>,
    /// Trajectories in the batches.
    pub trajectories: usize,
    /// Trained (assistant) tokens in the batches.
    pub tokens: usize,
    /// Trained tokens that carry the sampler's log-prob (the rest train with ratio 1).
    pub logprob_tokens: usize,
}

/// Filters, tokenizes and packs `groups` for a step that starts from `current_step`.
pub(crate) fn prepare_step(
    groups: &[ClaimedGroup],
    cfg: &TrainConfig,
    current_step: i64,
    tokenizer: &ChatTokenizer,
) -> Result<PreparedStep> {
    let params = FilterParams {
        zero_variance_tolerance: cfg.advantages.zero_variance_tolerance,
        current_step,
        accepted_staleness: cfg.accepted_staleness(),
        accept_unknown_policy_version: cfg.queue.unknown_policy_version == UnknownPolicyVersion::Accept,
    };
    let rewards: Vec<_> = groups.iter().map(ClaimedGroup::to_group_rewards).collect();
    let mut report = filter_groups(&rewards, &params);

    let mut kept: Vec<(&ClaimedGroup, Vec<f64>, Vec<TokenizedTrajectory>)> = Vec::new();
    let kept_before = report.kept.clone();
    for group in groups.iter().filter(|g| kept_before.contains(&g.id)) {
        let group_rewards = group.rewards();
        let tokenized = tokenize_group(group, tokenizer, cfg.max_seq_len)
            .and_then(|t| require_logprobs(t, cfg.loss.allow_training_without_logprobs));
        match tokenized {
            Ok(tokenized) => kept.push((group, group_rewards, tokenized)),
            Err((reason, detail)) => {
                report.mark_skipped(group.id, reason, Some(population_std(&group_rewards)), Some(detail));
            }
        }
    }

    let advantages_per_group: Vec<Vec<f64>> =
        kept.iter().map(|(_, r, _)| advantages(r, cfg.advantages.scale_rewards)).collect();
    let items: Vec<PackItem<'_>> = kept
        .iter()
        .zip(&advantages_per_group)
        .flat_map(|((_, _, trajs), advs)| {
            trajs.iter().zip(advs).map(|(t, a)| PackItem { trajectory: t, advantage: *a as f32 })
        })
        .collect();
    let batches =
        if items.is_empty() { Vec::new() } else { pack(&items, cfg.max_tokens_per_micro_batch, cfg.max_seq_len)? };
    Ok(PreparedStep {
        trajectories: items.len(),
        tokens: items.iter().map(|i| i.trajectory.trained_tokens()).sum(),
        logprob_tokens: items.iter().map(|i| logprob_tokens(i.trajectory)).sum(),
        trained: kept.iter().map(|(g, r, _)| (r.clone(), g.policy_version)).collect(),
        report,
        batches,
    })
}

/// Tokenizes every trajectory of a group; the first failure decides the group's skip reason.
fn tokenize_group(
    group: &ClaimedGroup,
    tokenizer: &ChatTokenizer,
    max_seq_len: usize,
) -> std::result::Result<Vec<TokenizedTrajectory>, (SkipReason, String)> {
    let items = group.trajectories.as_array().map(Vec::as_slice).unwrap_or_default();
    items
        .iter()
        .enumerate()
        .map(|(i, value)| {
            Trajectory::from_json(value).and_then(|t| tokenizer.tokenize(&t, max_seq_len)).map_err(|e| match e {
                TokenizeError::TooLong { .. } => (SkipReason::TooLong, format!("trajectory {i}: {e}")),
                TokenizeError::Invalid(_) => (SkipReason::Invalid, format!("trajectory {i}: {e}")),
            })
        })
        .collect()
}

/// Trained tokens of `t` that carry the sampler's log-prob.
fn logprob_tokens(t: &TokenizedTrajectory) -> usize {
    t.trained.iter().zip(&t.sampler_logprobs).filter(|(trained, lp)| **trained && lp.is_some()).count()
}

/// Refuses (as `invalid`) a group with a trajectory whose trained tokens carry no sampler log-prob
/// at all, unless `loss.allow_training_without_logprobs`: without them the importance ratio is 1
/// and off-policy samples would be trained as if on-policy.
fn require_logprobs(
    tokenized: Vec<TokenizedTrajectory>,
    allowed: bool,
) -> std::result::Result<Vec<TokenizedTrajectory>, (SkipReason, String)> {
    if allowed {
        return Ok(tokenized);
    }
    match tokenized.iter().position(|t| t.trained_tokens() > 0 && logprob_tokens(t) == 0) {
        Some(i) => Err((
            SkipReason::Invalid,
            format!(
                "trajectory {i}: no sampler log-probs on its trained tokens (send \"logprobs\", or set \
                 loss.allow_training_without_logprobs = true to train it with importance ratio 1)"
            ),
        )),
        None => Ok(tokenized),
    }
}
