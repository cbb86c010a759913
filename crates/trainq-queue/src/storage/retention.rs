//! Checkpoint retention: keep the last K whole checkpoints and every M-th step, delete the
//! others' objects (manifest first, so a half-deleted checkpoint never looks whole) and report
//! which steps went, so the worker can mark their rows.

use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;
use serde::{Deserialize, Serialize};

use super::store::{list_checkpoints, Store, StoredCheckpoint, MANIFEST_FILE};
use crate::error::{Error, Result};
use crate::ids::StepNumber;

/// Default for [`RetentionPolicy::keep_last`].
pub const DEFAULT_KEEP_LAST: usize = 5;
/// Default for [`RetentionPolicy::keep_every`].
pub const DEFAULT_KEEP_EVERY: u64 = 100;

/// Which checkpoints survive retention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetentionPolicy {
    /// The newest this many whole checkpoints are kept. At least 1 is always kept. Default
    /// `DEFAULT_KEEP_LAST`.
    pub keep_last: usize,
    /// Steps divisible by this are kept forever; 0 keeps none that way. Default
    /// `DEFAULT_KEEP_EVERY`.
    pub keep_every: u64,
}

impl Default for RetentionPolicy {
    fn default() -> Self {
        RetentionPolicy { keep_last: DEFAULT_KEEP_LAST, keep_every: DEFAULT_KEEP_EVERY }
    }
}

impl RetentionPolicy {
    /// Given the stored checkpoints (`(step, whole)`), the steps to delete, ascending.
    ///
    /// Whole checkpoints outside the last `keep_last` and not a multiple of `keep_every` go.
    /// Partial ones (no manifest) go when older than the newest whole checkpoint (a failed
    /// upload; milestones do not protect them); newer partial ones may be uploads in progress
    /// and stay.
    pub fn steps_to_delete(&self, stored: &[(StepNumber, bool)]) -> Vec<StepNumber> {
        let mut whole: Vec<StepNumber> = stored.iter().filter(|s| s.1).map(|s| s.0).collect();
        whole.sort_unstable();
        let Some(&newest_whole) = whole.last() else { return Vec::new() };
        let recent_from = whole.len().saturating_sub(self.keep_last.max(1));
        let recent = &whole[recent_from..];
        let mut doomed: Vec<StepNumber> = stored
            .iter()
            .filter(|&&(step, is_whole)| {
                let milestone = self.keep_every > 0 && step.get() % self.keep_every as i64 == 0;
                if is_whole {
                    !recent.contains(&step) && !milestone
                } else {
                    step < newest_whole
                }
            })
            .map(|s| s.0)
            .collect();
        doomed.sort_unstable();
        doomed.dedup();
        doomed
    }
}

/// Applies `policy` to the checkpoints of `model` in `store`; returns the deleted steps.
pub async fn apply_retention(store: &Store, model: &str, policy: &RetentionPolicy) -> Result<Vec<StepNumber>> {
    let stored = list_checkpoints(store, model).await?;
    let summary: Vec<(StepNumber, bool)> = stored.iter().map(|c| (c.step, c.has_manifest)).collect();
    let doomed = policy.steps_to_delete(&summary);
    for checkpoint in stored.iter().filter(|c| doomed.contains(&c.step)) {
        delete_checkpoint(store, model, checkpoint).await?;
        tracing::info!(model, step = %checkpoint.step, "retention deleted checkpoint");
    }
    Ok(doomed)
}

/// Deletes the manifest, then every other object of the checkpoint.
async fn delete_checkpoint(store: &Store, model: &str, checkpoint: &StoredCheckpoint) -> Result<()> {
    let manifest = store.checkpoint_file(model, checkpoint.step, MANIFEST_FILE);
    if checkpoint.has_manifest {
        match store.object_store().delete(&manifest).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(source) => return Err(Error::Store { what: "delete", path: manifest.to_string(), source }),
        }
    }
    let rest: Vec<_> = checkpoint.objects.iter().filter(|p| **p != manifest).cloned().collect();
    let dir = store.checkpoint_dir(model, checkpoint.step).to_string();
    store
        .object_store()
        .delete_stream(futures::stream::iter(rest.into_iter().map(Ok)).boxed())
        .try_for_each(|_| futures::future::ready(Ok(())))
        .await
        .or_else(|error| match error {
            object_store::Error::NotFound { .. } => Ok(()),
            source => Err(Error::Store { what: "delete", path: dir, source }),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(steps: impl IntoIterator<Item = i64>) -> Vec<(StepNumber, bool)> {
        steps.into_iter().map(|s| (StepNumber(s), true)).collect()
    }

    fn steps(raw: &[i64]) -> Vec<StepNumber> {
        raw.iter().copied().map(StepNumber).collect()
    }

    fn stored(raw: &[(i64, bool)]) -> Vec<(StepNumber, bool)> {
        raw.iter().map(|&(s, w)| (StepNumber(s), w)).collect()
    }

    #[test]
    fn the_last_k_and_every_mth_step_are_kept() {
        let policy = RetentionPolicy { keep_last: 2, keep_every: 4 };
        assert_eq!(policy.steps_to_delete(&whole(1..=9)), steps(&[1, 2, 3, 5, 6, 7]));
    }

    #[test]
    fn keep_every_zero_keeps_only_the_last_k_and_at_least_one_survives() {
        let policy = RetentionPolicy { keep_last: 0, keep_every: 0 };
        assert_eq!(policy.steps_to_delete(&whole([3, 1, 2])), steps(&[1, 2]));
        assert!(policy.steps_to_delete(&[]).is_empty());
    }

    #[test]
    fn partial_checkpoints_go_only_when_older_than_the_newest_whole_one() {
        let policy = RetentionPolicy { keep_last: 1, keep_every: 0 };
        let found = stored(&[(1, false), (2, true), (3, true), (4, false)]);
        assert_eq!(policy.steps_to_delete(&found), steps(&[1, 2]));
        let milestone = RetentionPolicy { keep_last: 1, keep_every: 2 };
        assert_eq!(milestone.steps_to_delete(&stored(&[(2, false), (3, true)])), steps(&[2]));
        assert!(policy.steps_to_delete(&stored(&[(1, false), (2, false)])).is_empty());
    }

    #[test]
    fn policies_deserialize_with_documented_defaults() {
        let policy: RetentionPolicy = serde_json::from_str(r#"{"keep_last": 2}"#).unwrap();
        assert_eq!(policy, RetentionPolicy { keep_last: 2, keep_every: DEFAULT_KEEP_EVERY });
        assert!(serde_json::from_str::<RetentionPolicy>(r#"{"keep": 2}"#).is_err());
    }
}
