//! The stable SQLSTATEs (custom class `TQ`) that the database raises for bad producer input.
//!
//! These codes are part of the producer contract (docs/sql-api.md) and are never renumbered.

/// Unknown or missing model.
pub const UNKNOWN_MODEL: &str = "TQ001";
/// `trajectories` is not an array, or is empty.
pub const EMPTY_GROUP: &str = "TQ002";
/// A trajectory is not a JSON object.
pub const TRAJECTORY_NOT_OBJECT: &str = "TQ003";
/// `reward` is missing or not a number.
pub const REWARD_NOT_NUMBER: &str = "TQ004";
/// `reward` is NaN or infinite, beyond ±1e100, or nonzero below 1e-100 in magnitude.
pub const REWARD_NOT_FINITE: &str = "TQ005";
/// Neither valid `messages` nor `prompt_ids`/`completion_ids` (missing, empty, both given).
pub const MISSING_CONTENT: &str = "TQ006";
/// A message is not an object or has an unknown role.
pub const MESSAGE_MALFORMED: &str = "TQ007";
/// A message's `content` is missing or of the wrong type.
pub const CONTENT_MALFORMED: &str = "TQ008";
/// No assistant turn to train on.
pub const NO_ASSISTANT_TURN: &str = "TQ009";
/// `tool_calls` malformed.
pub const TOOL_CALLS_MALFORMED: &str = "TQ010";
/// Token ids negative, not integers, or on a non-assistant message.
pub const TOKEN_IDS_MALFORMED: &str = "TQ011";
/// `logprobs` length differs from its tokens (or given without tokens).
pub const LOGPROBS_LENGTH: &str = "TQ012";
/// `logprobs` positive or not numbers.
pub const LOGPROBS_MALFORMED: &str = "TQ013";
/// `policy_version` negative.
pub const POLICY_VERSION_NEGATIVE: &str = "TQ014";
/// `policy_version` ahead of the model's current step.
pub const POLICY_VERSION_AHEAD: &str = "TQ015";
/// More trajectories than the model's `max_group_trajectories`.
pub const GROUP_TOO_LARGE: &str = "TQ016";
/// Trajectories larger than the model's `max_group_bytes`.
pub const PAYLOAD_TOO_LARGE: &str = "TQ017";
/// `metadata` or `metrics` not a JSON object.
pub const NOT_AN_OBJECT: &str = "TQ018";
/// `tools` malformed.
pub const TOOLS_MALFORMED: &str = "TQ019";
/// A JSON number beyond the range of a double (|x| > 1.7976931348623157e308), anywhere in a group.
pub const NUMBER_OUT_OF_RANGE: &str = "TQ020";
/// A value nested more than 64 levels deep in `trajectories` or `metadata`.
pub const NESTED_TOO_DEEP: &str = "TQ021";
/// A token id at or beyond the model's `vocab_size`.
pub const TOKEN_ID_BEYOND_VOCAB: &str = "TQ022";
/// `policy_version` missing while the model sets `queue.unknown_policy_version = "refuse"`.
pub const POLICY_VERSION_UNKNOWN: &str = "TQ030";

/// A fenced write found groups no longer held by its claim token (raised by trainq's own
/// queries, never by producer input); the statement wrote nothing.
pub const LOST_CLAIM: &str = "TQ100";

/// The SQLSTATE of a database error, if `err` is one.
pub fn code_of(err: &sqlx::Error) -> Option<String> {
    match err {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// Whether `code` is one of trainq's producer-input errors (`TQ0xx`): retrying cannot help.
pub fn is_bad_input(code: &str) -> bool {
    code.starts_with("TQ0")
}

/// Whether `code` is a transient failure (serialization, deadlock, connection) worth retrying.
pub fn is_retryable(code: &str) -> bool {
    matches!(code, "40001" | "40P01" | "57P01" | "08000" | "08003" | "08006")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn producer_codes_are_bad_input_and_not_retryable() {
        assert!(is_bad_input(UNKNOWN_MODEL));
        assert!(!is_retryable(REWARD_NOT_FINITE));
        assert!(is_retryable("40P01"));
        assert!(!is_bad_input("23505"));
        assert!(!is_bad_input(LOST_CLAIM));
    }
}
