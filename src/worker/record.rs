//! Pure summaries of a step's groups for its `trainq.steps` row (or its `trainq.skipped_passes`
//! row): reward mean of the trained groups, of every claimed group and of the skipped ones, the
//! mean of each group's own reward std, and the policy lag the step actually saw.

use trainq_queue::rl::advantages::{mean, population_std};
use trainq_queue::StepNumber;

/// What the step record says about the trained groups' rewards and ages.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TrainedGroupsSummary {
    /// Mean reward over every trained trajectory.
    pub reward_mean: Option<f64>,
    /// Mean over trained groups of each group's own population reward std.
    pub reward_std_mean: Option<f64>,
    /// Smallest `current_step − policy_version` among trained groups with a known version.
    pub policy_lag_min: Option<i64>,
    /// Largest `current_step − policy_version` among trained groups with a known version.
    pub policy_lag_max: Option<i64>,
}

/// Summarizes trained groups given as (rewards, policy_version), for a step that starts from
/// checkpoint `current_step` (the lag of a group sampled from it is 0).
pub fn summarize_trained(groups: &[(Vec<f64>, Option<StepNumber>)], current_step: StepNumber) -> TrainedGroupsSummary {
    if groups.is_empty() {
        return TrainedGroupsSummary::default();
    }
    let all: Vec<f64> = groups.iter().flat_map(|(r, _)| r.iter().copied()).collect();
    let stds: Vec<f64> = groups.iter().map(|(r, _)| population_std(r)).collect();
    let lags: Vec<i64> = groups.iter().filter_map(|(_, v)| v.map(|v| current_step - v)).collect();
    TrainedGroupsSummary {
        reward_mean: Some(mean(&all)),
        reward_std_mean: Some(mean(&stds)),
        policy_lag_min: lags.iter().copied().min(),
        policy_lag_max: lags.iter().copied().max(),
    }
}

/// The rewards of every group a step (or a skipped pass) claimed, trained or skipped.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ClaimedGroupsSummary {
    /// Mean reward over every claimed trajectory.
    pub reward_mean_claimed: Option<f64>,
    /// Mean reward over the trajectories of the skipped groups.
    pub reward_mean_skipped: Option<f64>,
    /// Mean over the skipped groups of each group's own population reward std.
    pub reward_std_mean_skipped: Option<f64>,
}

/// Summarizes claimed groups given as (rewards, skipped), so that reward curves also show the
/// groups a step could not learn from (zero variance is saturation, not silence).
pub fn summarize_claimed(groups: &[(Vec<f64>, bool)]) -> ClaimedGroupsSummary {
    let mean_of = |pick: &dyn Fn(bool) -> bool| {
        let all: Vec<f64> = groups.iter().filter(|(_, s)| pick(*s)).flat_map(|(r, _)| r.iter().copied()).collect();
        (!all.is_empty()).then(|| mean(&all))
    };
    let skipped_stds: Vec<f64> = groups.iter().filter(|(_, s)| *s).map(|(r, _)| population_std(r)).collect();
    ClaimedGroupsSummary {
        reward_mean_claimed: mean_of(&|_| true),
        reward_mean_skipped: mean_of(&|skipped| skipped),
        reward_std_mean_skipped: (!skipped_stds.is_empty()).then(|| mean(&skipped_stds)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claimed_rewards_cover_trained_and_skipped_groups_separately() {
        let groups = vec![(vec![0.0, 1.0], false), (vec![1.0, 1.0], true), (vec![1.0, 1.0, 1.0, 1.0], true)];
        let s = summarize_claimed(&groups);
        assert!((s.reward_mean_claimed.unwrap() - 7.0 / 8.0).abs() < 1e-12);
        assert_eq!((s.reward_mean_skipped, s.reward_std_mean_skipped), (Some(1.0), Some(0.0)));
        let none_skipped = summarize_claimed(&groups[..1]);
        assert_eq!((none_skipped.reward_mean_claimed, none_skipped.reward_mean_skipped), (Some(0.5), None));
    }

    #[test]
    fn rewards_and_lags_are_summarized_per_group() {
        let groups = vec![
            (vec![0.0, 1.0], Some(StepNumber(5))),
            (vec![1.0, 1.0, 0.0, 0.0], Some(StepNumber(3))),
            (vec![2.0, 4.0], None),
        ];
        let s = summarize_trained(&groups, StepNumber(5));
        assert!((s.reward_mean.unwrap() - 9.0 / 8.0).abs() < 1e-12);
        // Own stds: 0.5, 0.5, 1.0.
        assert!((s.reward_std_mean.unwrap() - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!((s.policy_lag_min, s.policy_lag_max), (Some(0), Some(2)));
    }

    #[test]
    fn no_trained_groups_means_nothing_to_report() {
        assert_eq!(summarize_trained(&[], StepNumber(3)), TrainedGroupsSummary::default());
    }
}
