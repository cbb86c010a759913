//! Newtypes for the identifiers that are easy to swap: a group's id and the claim token that
//! fences its writes are both UUIDs, and a step number travels from `trainq.steps` to the
//! store's `checkpoints/{step:06}/` path — one type each, so the compiler keeps them apart.

use std::fmt;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The id of a submitted group (`trainq.groups.id`, a UUID v7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, sqlx::Type)]
#[serde(transparent)]
#[sqlx(transparent)]
pub struct GroupId(pub Uuid);

/// The token written to every row of one claim; every later write of the claim is fenced on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type)]
#[serde(transparent)]
#[sqlx(transparent)]
pub struct ClaimToken(pub Uuid);

/// An optimizer step of a model: `trainq.steps.step`, `models.current_step`, a group's
/// `policy_version`, and the checkpoint directory `checkpoints/{step:06}/` in the store.
/// Step 0 is the base model (no checkpoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize, sqlx::Type)]
#[serde(transparent)]
#[sqlx(transparent)]
pub struct StepNumber(pub i64);

impl ClaimToken {
    /// A fresh token (UUID v7).
    pub fn new() -> ClaimToken {
        ClaimToken(Uuid::now_v7())
    }
}

impl Default for ClaimToken {
    fn default() -> ClaimToken {
        ClaimToken::new()
    }
}

impl StepNumber {
    /// The base model, before any step.
    pub const BASE: StepNumber = StepNumber(0);

    /// The step after this one.
    pub fn next(self) -> StepNumber {
        StepNumber(self.0 + 1)
    }

    /// The raw number.
    pub fn get(self) -> i64 {
        self.0
    }
}

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for ClaimToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Formats like the number; `{:06}` and other width flags apply (the store's directory names).
impl fmt::Display for StepNumber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// The number of steps from `earlier` to `self`: a group's policy lag is
/// `current_step - policy_version`.
impl std::ops::Sub for StepNumber {
    type Output = i64;

    fn sub(self, earlier: StepNumber) -> i64 {
        self.0 - earlier.0
    }
}

/// A step compares with a raw number (`step == 3`), the way a reader of `trainq.steps` does.
impl PartialEq<i64> for StepNumber {
    fn eq(&self, other: &i64) -> bool {
        self.0 == *other
    }
}

impl From<i64> for StepNumber {
    fn from(step: i64) -> StepNumber {
        StepNumber(step)
    }
}

impl From<Uuid> for GroupId {
    fn from(id: Uuid) -> GroupId {
        GroupId(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_numbers_format_like_store_directories() {
        assert_eq!(format!("{:06}", StepNumber(42)), "000042");
        assert_eq!(StepNumber::BASE.next(), StepNumber(1));
        assert_eq!(StepNumber(7) - StepNumber(4), 3);
    }

    #[test]
    fn claim_tokens_are_fresh() {
        assert_ne!(ClaimToken::new(), ClaimToken::new());
    }
}
