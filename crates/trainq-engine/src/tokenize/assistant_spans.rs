//! Where each assistant turn lies in the rendered conversation, found by rendering prefixes.
//!
//! For assistant message `i`, the turn starts where `render(messages[..i],
//! add_generation_prompt=true)` ends, when that text is a prefix of the full render (the usual
//! case). It ends where `render(messages[..=i])` ends, without its trailing whitespace, when
//! that text is a prefix of the full render; otherwise just after the first `eos_token` at or
//! after the start. The second rule exists because some templates are not prefix-stable: Qwen3
//! adds an empty `<think>` block to the *last* assistant turn only, so `messages[..=i]` renders
//! turn `i` differently from the full conversation. When even the start prefix differs (Qwen3
//! with `reasoning_content` on an intermediate turn), the start is found by searching for the
//! generation header (the text `add_generation_prompt` appends) after the previous turn.

use super::chat_template::{ChatTemplate, PreparedConversation};
use super::trajectory::TokenizeError;

/// Byte range `[start, end)` of one assistant turn in the full render.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AssistantSpan {
    /// Index of the assistant message in `messages`.
    pub message_index: usize,
    /// First byte of the turn's generated text (after the assistant header).
    pub start: usize,
    /// One past the last byte (after the end-of-turn token).
    pub end: usize,
}

/// Finds the span of every assistant message in `full`, the render of the whole conversation.
pub fn locate_assistant_spans(
    template: &ChatTemplate,
    conversation: &PreparedConversation,
    full: &str,
) -> Result<Vec<AssistantSpan>, TokenizeError> {
    let render =
        |upto: usize, add_generation_prompt: bool| template.render_prefix(conversation, upto, add_generation_prompt);
    let mut spans = Vec::new();
    let mut cursor = 0;
    for i in 0..conversation.len() {
        if conversation.role(i) != Some("assistant") {
            continue;
        }
        if i == 0 {
            return Err(TokenizeError::Invalid("message 0 is an assistant turn with no prompt before it".into()));
        }
        let prompt = render(i, true)?;
        let start = if full.starts_with(&prompt) && prompt.len() >= cursor {
            prompt.len()
        } else {
            let header = generation_header(&prompt, &render(i, false)?).ok_or_else(|| {
                TokenizeError::Invalid(format!("message {i}: cannot find where the assistant turn starts"))
            })?;
            full[cursor..]
                .find(header)
                .map(|at| cursor + at + header.len())
                .ok_or_else(|| TokenizeError::Invalid(format!("message {i}: assistant header {header:?} not found")))?
        };
        let through = render(i + 1, false)?;
        let end = if full.starts_with(&through) && through.trim_end().len() > start {
            through.trim_end().len()
        } else {
            end_by_eos(template, full, start).ok_or_else(|| {
                TokenizeError::Invalid(format!(
                    "message {i}: cannot find where the assistant turn ends (eos_token not found)"
                ))
            })?
        };
        spans.push(AssistantSpan { message_index: i, start, end });
        cursor = end;
    }
    Ok(spans)
}

/// The text that `add_generation_prompt` appends, e.g. `<|im_start|>assistant\n`.
fn generation_header<'a>(with_prompt: &'a str, without: &str) -> Option<&'a str> {
    with_prompt.strip_prefix(without).filter(|h| !h.is_empty())
}

fn end_by_eos(template: &ChatTemplate, full: &str, start: usize) -> Option<usize> {
    let eos = template.eos_token().filter(|e| !e.is_empty())?;
    full[start..].find(eos).map(|at| start + at + eos.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A ChatML template that, like Qwen3, marks only the last assistant turn differently.
    const UNSTABLE_CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and loop.last %}<think></think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    fn spans(source: &str, messages: serde_json::Value) -> (String, Vec<(String, usize)>) {
        let template = ChatTemplate::new(source, None, Some("<|im_end|>".into())).unwrap();
        let conversation = PreparedConversation::new(messages.as_array().unwrap(), None);
        let full = template.render_prefix(&conversation, conversation.len(), false).unwrap();
        let found = locate_assistant_spans(&template, &conversation, &full).unwrap();
        let texts = found.iter().map(|s| (full[s.start..s.end].to_string(), s.message_index)).collect();
        (full, texts)
    }

    #[test]
    fn spans_cover_assistant_text_and_end_token_only() {
        let (_, found) = spans(
            UNSTABLE_CHATML,
            json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a1"},
                   {"role": "user", "content": "more"}, {"role": "assistant", "content": "a2"}]),
        );
        assert_eq!(found, vec![("a1<|im_end|>".to_string(), 1), ("<think></think>a2<|im_end|>".to_string(), 3)]);
    }

    #[test]
    fn an_assistant_first_conversation_is_invalid() {
        let template = ChatTemplate::new(UNSTABLE_CHATML, None, Some("<|im_end|>".into())).unwrap();
        let conversation = PreparedConversation::new(&[json!({"role": "assistant", "content": "x"})], None);
        assert!(locate_assistant_spans(&template, &conversation, "x").is_err());
    }
}
