//! A trajectory as producers submit it (chat messages or pre-tokenized ids) and as the trainer
//! consumes it (ids, a per-position train flag, the sampler's log-probs).

use serde::Deserialize;

/// One rollout from a group, in either of its two submitted forms.
///
/// Chat form: `messages` (OpenAI format) and optional `tools`; an assistant message may carry
/// the sampler's `token_ids` and `logprobs` for its turn. Pre-tokenized form: `prompt_ids`,
/// `completion_ids` and optional `logprobs` (one per completion id). Other fields (`reward`,
/// `metrics`, …) are ignored here.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct Trajectory {
    /// OpenAI-format chat messages.
    #[serde(default)]
    pub messages: Option<Vec<serde_json::Value>>,
    /// OpenAI-format tool schemas passed to the chat template.
    #[serde(default)]
    pub tools: Option<serde_json::Value>,
    /// Pre-tokenized prompt (not trained).
    #[serde(default)]
    pub prompt_ids: Option<Vec<i64>>,
    /// Pre-tokenized completion (trained).
    #[serde(default)]
    pub completion_ids: Option<Vec<i64>>,
    /// Sampler log-probs of `completion_ids` (`null` entries allowed).
    #[serde(default)]
    pub logprobs: Option<Vec<Option<f32>>>,
}

impl Trajectory {
    /// Reads a trajectory from its JSON object.
    pub fn from_json(value: &serde_json::Value) -> Result<Self, TokenizeError> {
        Trajectory::deserialize(value).map_err(|e| TokenizeError::Invalid(format!("trajectory: {e}")))
    }
}

/// A trajectory turned into model input.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenizedTrajectory {
    /// Token ids of the whole conversation.
    pub ids: Vec<i64>,
    /// Per position of `ids`: true where the token is an assistant / completion token to train on.
    pub trained: Vec<bool>,
    /// Per position of `ids`: the sampler's log-prob of that token, where it sent one.
    pub sampler_logprobs: Vec<Option<f32>>,
}

impl TokenizedTrajectory {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// True when there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Number of trained tokens.
    pub fn trained_tokens(&self) -> usize {
        self.trained.iter().filter(|t| **t).count()
    }

    /// Keeps the first `len` tokens (with their train flags and log-probs); a no-op when shorter.
    pub fn truncate(&mut self, len: usize) {
        self.ids.truncate(len);
        self.trained.truncate(len);
        self.sampler_logprobs.truncate(len);
    }

    /// Appends tokens that share one train flag, with their sampler log-probs (or none).
    pub(crate) fn extend(&mut self, ids: &[i64], trained: bool, logprobs: Option<&[Option<f32>]>) {
        self.ids.extend_from_slice(ids);
        self.trained.extend(std::iter::repeat_n(trained, ids.len()));
        match logprobs {
            Some(lp) => self.sampler_logprobs.extend_from_slice(lp),
            None => self.sampler_logprobs.extend(std::iter::repeat_n(None, ids.len())),
        }
    }
}

/// Why a trajectory could not be tokenized. The worker maps `TooLong` to the group's
/// `too_long` skip reason and `Invalid` to `invalid`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TokenizeError {
    /// The trajectory has more tokens than `max_seq_len`; it is never truncated.
    #[error("trajectory has {tokens} tokens, more than max_seq_len {max_seq_len}")]
    TooLong {
        /// Its token count.
        tokens: usize,
        /// The configured limit.
        max_seq_len: usize,
    },
    /// The trajectory's content cannot be used (bad fields, template refusal, mismatched ids).
    #[error("{0}")]
    Invalid(String),
}

impl From<crate::error::Error> for TokenizeError {
    fn from(e: crate::error::Error) -> Self {
        TokenizeError::Invalid(e.to_string())
    }
}

impl From<TokenizeError> for crate::error::Error {
    fn from(e: TokenizeError) -> Self {
        crate::error::Error::Tokenize(e.to_string())
    }
}

/// Reads the sampler's log-probs for an assistant turn: a plain array of numbers (or nulls),
/// or OpenAI's `{"content": [{"logprob": …}, …]}` object.
pub(crate) fn parse_logprobs(value: &serde_json::Value) -> Result<Vec<Option<f32>>, TokenizeError> {
    let entries = match value {
        serde_json::Value::Array(items) => items.clone(),
        serde_json::Value::Object(obj) => match obj.get("content") {
            Some(serde_json::Value::Array(items)) => {
                items.iter().map(|i| i.get("logprob").cloned().unwrap_or_default()).collect()
            }
            _ => return Err(TokenizeError::Invalid("logprobs object without a content array".into())),
        },
        _ => return Err(TokenizeError::Invalid("logprobs must be an array or an OpenAI logprobs object".into())),
    };
    entries
        .iter()
        .map(|v| match v {
            serde_json::Value::Null => Ok(None),
            v => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| TokenizeError::Invalid(format!("logprob {v} is not a number"))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn truncation_keeps_ids_flags_and_logprobs_aligned() {
        let mut t = TokenizedTrajectory::default();
        t.extend(&[1, 2], false, None);
        t.extend(&[3, 4, 5], true, Some(&[Some(-0.1), Some(-0.2), Some(-0.3)]));
        t.truncate(4);
        assert_eq!(t.ids, vec![1, 2, 3, 4]);
        assert_eq!(t.trained, vec![false, false, true, true]);
        assert_eq!(t.sampler_logprobs, vec![None, None, Some(-0.1), Some(-0.2)]);
        t.truncate(10);
        assert_eq!(t.len(), 4);
    }

    #[test]
    fn logprobs_are_read_from_arrays_and_openai_objects() {
        assert_eq!(parse_logprobs(&json!([-0.5, null])).unwrap(), vec![Some(-0.5), None]);
        let openai = json!({"content": [{"token": "a", "logprob": -1.0}, {"token": "b", "logprob": -2.0}]});
        assert_eq!(parse_logprobs(&openai).unwrap(), vec![Some(-1.0), Some(-2.0)]);
        assert!(parse_logprobs(&json!("x")).is_err());
    }

    #[test]
    fn unknown_trajectory_fields_are_ignored() {
        let t = Trajectory::from_json(&json!({"prompt_ids": [1], "completion_ids": [2], "reward": 1.0})).unwrap();
        assert_eq!(t.completion_ids, Some(vec![2]));
    }
}
