//! A model's tokenizer and chat template together: trajectories in, trained token ids out.
//!
//! Chat trajectories are rendered once in full and tokenized once (no special tokens added, as
//! transformers' `apply_chat_template(tokenize=True)` does), so the ids always equal the
//! tokenization of the full render. Assistant turns are located as byte spans of the render
//! (see [`super::assistant_spans`]) and mapped onto tokens through the tokenizer's byte offsets:
//! a token is trained when it starts inside a span. Where an assistant message carries the
//! sampler's `token_ids`, the tokens of its span are replaced by exactly those ids (and their
//! `logprobs` kept). If a token straddles the start of such a span (content beginning with
//! "\n" after a header ending in "\n"), the prompt text before it is tokenized on its own, as
//! the sampler tokenized its prompt; the end must fall on a token boundary (checked).

use std::path::Path;

use tokenizers::Tokenizer;

use super::assistant_spans::{locate_assistant_spans, AssistantSpan};
use super::chat_template::{ChatTemplate, PreparedConversation, RenderRequest};
use super::trajectory::{parse_logprobs, TokenizeError, TokenizedTrajectory, Trajectory};
use crate::error::{Error, Result};

/// Tokenizer plus chat template of one model directory.
#[derive(Debug)]
pub struct ChatTokenizer {
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    eos_id: Option<i64>,
}

impl ChatTokenizer {
    /// Loads `tokenizer.json` and `tokenizer_config.json` (its `chat_template`, `bos_token`,
    /// `eos_token`; a `chat_template.jinja` file next to them wins) from a model directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let tokenizer_path = dir.join("tokenizer.json");
        let tokenizer =
            Tokenizer::from_file(&tokenizer_path).map_err(|e| Error::model(&tokenizer_path, e.to_string()))?;
        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text).map_err(Error::json(config_path.display().to_string()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(e) => return Err(Error::io(&config_path)(e)),
        };
        let jinja_path = dir.join("chat_template.jinja");
        let source = match std::fs::read_to_string(&jinja_path) {
            Ok(text) => Some(text),
            Err(_) => template_source(&config["chat_template"]),
        };
        Self::new(tokenizer, source.as_deref(), token_text(&config["bos_token"]), token_text(&config["eos_token"]))
    }

    /// Builds from parts; `chat_template` may be absent for pre-tokenized data only.
    pub fn new(
        tokenizer: Tokenizer,
        chat_template: Option<&str>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self> {
        let eos_id = eos_token.as_deref().and_then(|t| tokenizer.token_to_id(t)).map(i64::from);
        let template = chat_template.map(|source| ChatTemplate::new(source, bos_token, eos_token)).transpose()?;
        Ok(Self { tokenizer, template, eos_id })
    }

    /// Passes `kwargs` to every render of the chat template (the model's `chat_template_kwargs`,
    /// e.g. `{"enable_thinking": false}` for Qwen3), as `apply_chat_template(..., **kwargs)` does.
    pub fn with_template_kwargs(mut self, kwargs: serde_json::Map<String, serde_json::Value>) -> Self {
        if let Some(template) = self.template.as_mut() {
            template.set_kwargs(kwargs);
        }
        self
    }

    /// The underlying tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Renders messages with the chat template.
    pub fn render(&self, request: RenderRequest<'_>) -> Result<String> {
        self.template()?.render(request)
    }

    /// Tokenizes one trajectory; longer than `max_seq_len` is an error, never truncated.
    pub fn tokenize(&self, trajectory: &Trajectory, max_seq_len: usize) -> Result<TokenizedTrajectory, TokenizeError> {
        let tokenized = match (&trajectory.messages, &trajectory.completion_ids) {
            (Some(messages), _) => self.tokenize_chat(messages, trajectory.tools.as_ref())?,
            (None, Some(completion)) => pretokenized(
                trajectory.prompt_ids.as_deref().unwrap_or(&[]),
                completion,
                trajectory.logprobs.as_deref(),
            )?,
            (None, None) => {
                return Err(TokenizeError::Invalid("trajectory has neither messages nor completion_ids".into()))
            }
        };
        if tokenized.len() > max_seq_len {
            return Err(TokenizeError::TooLong { tokens: tokenized.len(), max_seq_len });
        }
        if tokenized.trained_tokens() == 0 {
            return Err(TokenizeError::Invalid("trajectory has no assistant tokens to train on".into()));
        }
        Ok(tokenized)
    }

    fn template(&self) -> Result<&ChatTemplate> {
        self.template.as_ref().ok_or_else(|| Error::Tokenize("the model has no chat_template".into()))
    }

    fn tokenize_chat(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&serde_json::Value>,
    ) -> Result<TokenizedTrajectory, TokenizeError> {
        let template = self.template()?;
        let conversation = PreparedConversation::new(messages, tools);
        let full = template.render_prefix(&conversation, conversation.len(), false)?;
        let spans = locate_assistant_spans(template, &conversation, &full)?;
        let encoding = self
            .tokenizer
            .encode(full.as_str(), false)
            .map_err(|e| TokenizeError::Invalid(format!("tokenizer: {e}")))?;
        let ids = to_i64(encoding.get_ids());
        let offsets = encoding.get_offsets();
        let mut out = TokenizedTrajectory::default();
        let mut cursor = 0;
        for span in spans {
            let first = offsets.partition_point(|o| o.0 < span.start);
            let last = offsets.partition_point(|o| o.0 < span.end);
            match sampler_turn(&messages[span.message_index])? {
                Some((token_ids, logprobs)) => {
                    check_end_boundary(offsets, first, last, &span)?;
                    if offsets.get(first).is_some_and(|o| o.0 == span.start) {
                        out.extend(&ids[cursor..first], false, None);
                    } else {
                        // A token straddles the header and the turn (e.g. content starting with
                        // "\n"): tokenize the prompt text up to the turn on its own, as the sampler did.
                        let from = offsets.get(cursor).map_or(span.start, |o| o.0);
                        out.extend(&self.encode(&full[from..span.start])?, false, None);
                    }
                    self.splice_sampler_turn(&mut out, &token_ids, logprobs.as_deref(), ids.get(last.wrapping_sub(1)))?;
                }
                None => {
                    out.extend(&ids[cursor..first], false, None);
                    out.extend(&ids[first..last], true, None);
                }
            }
            cursor = last;
        }
        out.extend(&ids[cursor..], false, None);
        Ok(out)
    }

    /// Token ids of `text`, without added special tokens.
    fn encode(&self, text: &str) -> Result<Vec<i64>, TokenizeError> {
        let encoding =
            self.tokenizer.encode(text, false).map_err(|e| TokenizeError::Invalid(format!("tokenizer: {e}")))?;
        Ok(to_i64(encoding.get_ids()))
    }

    /// Puts the sampler's own ids for a turn in place of the template's; when they lack the
    /// end-of-turn token that the template's span ends with, it is appended (trained, no logprob).
    fn splice_sampler_turn(
        &self,
        out: &mut TokenizedTrajectory,
        token_ids: &[i64],
        logprobs: Option<&[Option<f32>]>,
        template_last: Option<&i64>,
    ) -> Result<(), TokenizeError> {
        if let Some(lp) = logprobs {
            if lp.len() != token_ids.len() {
                return Err(TokenizeError::Invalid(format!("{} logprobs for {} token_ids", lp.len(), token_ids.len())));
            }
        }
        out.extend(token_ids, true, logprobs);
        if let (Some(eos), Some(&last)) = (self.eos_id, template_last) {
            if last == eos && token_ids.last() != Some(&eos) {
                out.extend(&[eos], true, None);
            }
        }
        Ok(())
    }
}

/// The sampler's `token_ids` (and `logprobs`) of an assistant message, when it sent them.
type SamplerTurn = (Vec<i64>, Option<Vec<Option<f32>>>);

fn sampler_turn(message: &serde_json::Value) -> Result<Option<SamplerTurn>, TokenizeError> {
    let Some(ids) = message.get("token_ids").filter(|v| !v.is_null()) else { return Ok(None) };
    let ids: Vec<i64> =
        serde_json::from_value(ids.clone()).map_err(|e| TokenizeError::Invalid(format!("token_ids: {e}")))?;
    if ids.is_empty() {
        return Err(TokenizeError::Invalid("assistant token_ids is empty".into()));
    }
    let logprobs = message.get("logprobs").filter(|v| !v.is_null()).map(parse_logprobs).transpose()?;
    Ok(Some((ids, logprobs)))
}

fn to_i64(ids: &[u32]) -> Vec<i64> {
    ids.iter().map(|&id| i64::from(id)).collect()
}

/// A spliced turn must end on a token boundary (it does when it ends with a special token).
fn check_end_boundary(
    offsets: &[(usize, usize)],
    first: usize,
    last: usize,
    span: &AssistantSpan,
) -> Result<(), TokenizeError> {
    if last > first && offsets[last - 1].1 == span.end {
        Ok(())
    } else {
        Err(TokenizeError::Invalid(format!(
            "message {}: a token straddles the end of the assistant turn, cannot splice the sampler's token_ids",
            span.message_index
        )))
    }
}

fn pretokenized(
    prompt: &[i64],
    completion: &[i64],
    logprobs: Option<&[Option<f32>]>,
) -> Result<TokenizedTrajectory, TokenizeError> {
    if let Some(lp) = logprobs {
        if lp.len() != completion.len() {
            return Err(TokenizeError::Invalid(format!(
                "{} logprobs for {} completion_ids",
                lp.len(),
                completion.len()
            )));
        }
    }
    let mut out = TokenizedTrajectory::default();
    out.extend(prompt, false, None);
    out.extend(completion, true, logprobs);
    Ok(out)
}

/// `chat_template` is a string, or a list of `{name, template}` of which `default` is used.
fn template_source(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(named) => {
            named.iter().find(|t| t["name"] == "default").and_then(|t| t["template"].as_str()).map(str::to_string)
        }
        _ => None,
    }
}

/// A special token given as a string or as an `{"content": …}` added-token object.
fn token_text(value: &serde_json::Value) -> Option<String> {
    value.as_str().or_else(|| value["content"].as_str()).map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pretokenized_trajectories_pass_through_with_their_logprobs() {
        let t = pretokenized(&[1, 2], &[3, 4], Some(&[Some(-0.1), None])).unwrap();
        assert_eq!(t.ids, vec![1, 2, 3, 4]);
        assert_eq!(t.trained, vec![false, false, true, true]);
        assert_eq!(t.sampler_logprobs, vec![None, None, Some(-0.1), None]);
        assert!(pretokenized(&[1], &[3, 4], Some(&[Some(-0.1)])).is_err());
    }

    #[test]
    fn special_tokens_are_read_in_both_forms() {
        assert_eq!(token_text(&serde_json::json!("<s>")), Some("<s>".into()));
        assert_eq!(token_text(&serde_json::json!({"content": "</s>"})), Some("</s>".into()));
        assert_eq!(token_text(&serde_json::Value::Null), None);
    }
}
