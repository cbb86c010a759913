//! Group filters: decide per group, from its own rewards and policy version, whether it can teach
//! the policy anything, and report the decisions in one log line.

use std::fmt;

use crate::ids::{GroupId, StepNumber};

use super::advantages::population_std;

/// Why a claimed group is not trained (the database enum `trainq.skip_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SkipReason {
    /// The population std of the group's own rewards is below the tolerance: all advantages are 0.
    ZeroVariance,
    /// `current_step − policy_version` is beyond the accepted staleness.
    Stale,
    /// The group could not be rendered or tokenized.
    Invalid,
    /// A trajectory is longer than `max_seq_len`.
    TooLong,
}

impl SkipReason {
    /// Every reason, in the order reports list them.
    pub const ALL: [SkipReason; 4] = [Self::ZeroVariance, Self::Stale, Self::Invalid, Self::TooLong];

    /// The database enum label, e.g. `zero_variance`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ZeroVariance => "zero_variance",
            Self::Stale => "stale",
            Self::Invalid => "invalid",
            Self::TooLong => "too_long",
        }
    }
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The rewards and policy version of one claimed group.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupRewards {
    /// Group id.
    pub id: GroupId,
    /// The reward of each trajectory, in order.
    pub rewards: Vec<f64>,
    /// Checkpoint step the rollouts were sampled from; `None` = unknown (stale unless accepted).
    pub policy_version: Option<StepNumber>,
    /// Why the group cannot be used at all (its stored JSON did not decode), if so: it is skipped
    /// `invalid` with this detail before any other check.
    pub unusable: Option<String>,
}

/// What the filter compares against.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FilterParams {
    /// A group whose population reward std is below this is `zero_variance`.
    pub zero_variance_tolerance: f64,
    /// The model's current step (the step being trained starts from it).
    pub current_step: StepNumber,
    /// Largest accepted `current_step − policy_version` (0 when on-policy).
    pub accepted_staleness: i64,
    /// Train groups whose `policy_version` is unknown (`queue.unknown_policy_version = "accept"`);
    /// otherwise they are `stale`.
    pub accept_unknown_policy_version: bool,
}

/// A group the worker will not train, with its reason and its own reward std.
#[derive(Debug, Clone, PartialEq)]
pub struct SkippedGroup {
    /// Group id.
    pub id: GroupId,
    /// Why it is skipped.
    pub reason: SkipReason,
    /// The population std of the group's own rewards.
    pub std: Option<f64>,
    /// Free text, e.g. "policy lag 3 > 1".
    pub detail: Option<String>,
}

/// The filter's decisions for one step. `Display` is the step's one log line.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FilterReport {
    /// Groups to train, in claim order.
    pub kept: Vec<GroupId>,
    /// Groups not to train.
    pub skipped: Vec<SkippedGroup>,
}

/// Classifies one group: `Some(skip)` when it cannot be trained, `None` when it is kept.
/// An unusable group is `invalid` whatever its rewards; then zero variance is checked (the std is the group's own, a group of one has std 0), then
/// staleness: lag `current_step − policy_version` beyond the accepted staleness, or an unknown
/// version unless accepted.
pub fn classify_group(group: &GroupRewards, params: &FilterParams) -> Option<SkippedGroup> {
    if let Some(why) = &group.unusable {
        return Some(SkippedGroup { id: group.id, reason: SkipReason::Invalid, std: None, detail: Some(why.clone()) });
    }
    let std = population_std(&group.rewards);
    let skip = |reason, detail| Some(SkippedGroup { id: group.id, reason, std: Some(std), detail });
    if group.rewards.len() < 2 || std < params.zero_variance_tolerance {
        let detail = format!("{} reward(s), std {std} < {}", group.rewards.len(), params.zero_variance_tolerance);
        return skip(SkipReason::ZeroVariance, Some(detail));
    }
    match group.policy_version {
        Some(version) => {
            let lag = params.current_step - version;
            if lag > params.accepted_staleness {
                return skip(SkipReason::Stale, Some(format!("policy lag {lag} > {}", params.accepted_staleness)));
            }
        }
        None if !params.accept_unknown_policy_version => {
            let detail = "policy_version unknown (NULL) and queue.unknown_policy_version is not \"accept\"";
            return skip(SkipReason::Stale, Some(detail.to_string()));
        }
        None => {}
    }
    None
}

/// Runs [`classify_group`] over a batch.
pub fn filter_groups(groups: &[GroupRewards], params: &FilterParams) -> FilterReport {
    let mut report = FilterReport::default();
    for group in groups {
        match classify_group(group, params) {
            Some(skip) => report.skipped.push(skip),
            None => report.kept.push(group.id),
        }
    }
    report
}

impl FilterReport {
    /// Moves a kept group to the skipped list (e.g. `invalid` or `too_long` found while
    /// tokenizing). Returns false when `id` was not kept.
    pub fn mark_skipped(&mut self, id: GroupId, reason: SkipReason, std: Option<f64>, detail: Option<String>) -> bool {
        let Some(pos) = self.kept.iter().position(|k| *k == id) else { return false };
        self.kept.remove(pos);
        self.skipped.push(SkippedGroup { id, reason, std, detail });
        true
    }

    /// How many groups were skipped for `reason`.
    pub fn count(&self, reason: SkipReason) -> usize {
        self.skipped.iter().filter(|s| s.reason == reason).count()
    }

    /// Skipped counts by reason as a JSON object (for `trainq.steps.groups_skipped`), zero counts left out.
    pub fn counts_json(&self) -> serde_json::Value {
        let map = SkipReason::ALL
            .iter()
            .filter(|r| self.count(**r) > 0)
            .map(|r| (r.as_str().to_string(), serde_json::Value::from(self.count(*r))))
            .collect();
        serde_json::Value::Object(map)
    }
}

impl fmt::Display for FilterReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let total = self.kept.len() + self.skipped.len();
        write!(f, "filter: kept {} of {total} groups; skipped", self.kept.len())?;
        for reason in SkipReason::ALL {
            write!(f, " {reason}={}", self.count(reason))?;
        }
        if !self.skipped.is_empty() {
            f.write_str("; skipped group stds:")?;
            for (i, s) in self.skipped.iter().enumerate() {
                let sep = if i == 0 { " " } else { ", " };
                match s.std {
                    Some(std) => write!(f, "{sep}{} {} std={std}", s.id, s.reason)?,
                    None => write!(f, "{sep}{} {} std=?", s.id, s.reason)?,
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARAMS: FilterParams = FilterParams {
        zero_variance_tolerance: 1e-6,
        current_step: StepNumber(5),
        accepted_staleness: 1,
        accept_unknown_policy_version: true,
    };

    fn group(n: u128, rewards: &[f64], policy_version: Option<i64>) -> GroupRewards {
        let policy_version = policy_version.map(StepNumber);
        GroupRewards {
            id: GroupId(uuid::Uuid::from_u128(n)),
            rewards: rewards.to_vec(),
            policy_version,
            unusable: None,
        }
    }

    #[test]
    fn groups_equal_inside_but_different_across_are_all_zero_variance() {
        // The seed report: every group is constant, the batch as a whole is not.
        let groups =
            [group(1, &[0.0, 0.0, 0.0], Some(5)), group(2, &[1.0, 1.0], Some(5)), group(3, &[0.5; 4], Some(5))];
        let report = filter_groups(&groups, &PARAMS);
        assert!(report.kept.is_empty());
        assert_eq!(report.count(SkipReason::ZeroVariance), 3);
        assert!(report.skipped.iter().all(|s| s.std == Some(0.0)));
        let line = report.to_string();
        assert!(
            line.starts_with("filter: kept 0 of 3 groups; skipped zero_variance=3 stale=0 invalid=0 too_long=0"),
            "{line}"
        );
        for n in 1..=3u128 {
            assert!(line.contains(&format!("{} zero_variance std=0", GroupId(uuid::Uuid::from_u128(n)))), "{line}");
        }
    }

    #[test]
    fn a_group_of_one_is_zero_variance() {
        let skip = classify_group(&group(1, &[0.9], None), &PARAMS).unwrap();
        assert_eq!((skip.reason, skip.std), (SkipReason::ZeroVariance, Some(0.0)));
    }

    #[test]
    fn variance_below_tolerance_is_skipped_above_is_kept() {
        // [0, 1e-7]: population std 5e-8 < 1e-6
        let skip = classify_group(&group(1, &[0.0, 1e-7], None), &PARAMS).unwrap();
        assert_eq!(skip.reason, SkipReason::ZeroVariance);
        assert!((skip.std.unwrap() - 5e-8).abs() < 1e-15);
        // [0, 1]: population std 0.5
        assert_eq!(classify_group(&group(2, &[0.0, 1.0], None), &PARAMS), None);
    }

    #[test]
    fn policy_lag_beyond_the_accepted_staleness_is_stale() {
        // current 5, accepted 1: version 4 (lag 1) kept, version 3 (lag 2) stale, unknown kept when accepted
        assert_eq!(classify_group(&group(1, &[0.0, 1.0], Some(4)), &PARAMS), None);
        let skip = classify_group(&group(2, &[0.0, 1.0], Some(3)), &PARAMS).unwrap();
        assert_eq!((skip.reason, skip.std), (SkipReason::Stale, Some(0.5)));
        assert_eq!(skip.detail.as_deref(), Some("policy lag 2 > 1"));
        assert_eq!(classify_group(&group(3, &[0.0, 1.0], None), &PARAMS), None);
    }

    #[test]
    fn an_unknown_policy_version_is_stale_unless_accepted() {
        let params = FilterParams { accept_unknown_policy_version: false, ..PARAMS };
        let skip = classify_group(&group(1, &[0.0, 1.0], None), &params).unwrap();
        assert_eq!(skip.reason, SkipReason::Stale);
        assert!(skip.detail.unwrap().contains("queue.unknown_policy_version"));
        assert_eq!(classify_group(&group(2, &[0.0, 1.0], Some(5)), &params), None);
    }

    #[test]
    fn an_unusable_group_is_invalid_with_its_error_whatever_its_rewards() {
        let mut bad = group(1, &[0.0, 1.0], Some(5));
        bad.unusable = Some("metadata: number out of range".into());
        let skip = classify_group(&bad, &PARAMS).unwrap();
        assert_eq!((skip.reason, skip.std), (SkipReason::Invalid, None));
        assert_eq!(skip.detail.as_deref(), Some("metadata: number out of range"));
        let report = filter_groups(&[bad, group(2, &[0.0, 1.0], Some(5))], &PARAMS);
        assert_eq!(report.kept, vec![GroupId(uuid::Uuid::from_u128(2))]);
    }

    #[test]
    fn the_report_counts_each_reason_and_lists_each_skipped_std() {
        let groups = [group(1, &[0.0, 1.0], Some(5)), group(2, &[2.0, 2.0], Some(5)), group(3, &[0.0, 1.0], Some(0))];
        let mut report = filter_groups(&groups, &PARAMS);
        assert!(report.mark_skipped(GroupId(uuid::Uuid::from_u128(1)), SkipReason::TooLong, Some(0.5), None));
        assert!(!report.mark_skipped(GroupId(uuid::Uuid::from_u128(9)), SkipReason::Invalid, None, None));
        let line = report.to_string();
        assert!(line.contains("kept 0 of 3 groups; skipped zero_variance=1 stale=1 invalid=0 too_long=1"), "{line}");
        assert!(line.contains(&format!("{} zero_variance std=0", GroupId(uuid::Uuid::from_u128(2)))), "{line}");
        assert!(line.contains(&format!("{} stale std=0.5", GroupId(uuid::Uuid::from_u128(3)))), "{line}");
        assert!(line.contains(&format!("{} too_long std=0.5", GroupId(uuid::Uuid::from_u128(1)))), "{line}");
        assert_eq!(report.counts_json(), serde_json::json!({"zero_variance": 1, "stale": 1, "too_long": 1}));
    }
}
