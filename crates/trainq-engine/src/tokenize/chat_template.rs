//! A Hugging Face chat template (`tokenizer_config.json`'s `chat_template`) rendered with minijinja.
//!
//! The environment mirrors transformers' `ImmutableSandboxedEnvironment(trim_blocks=True,
//! lstrip_blocks=True)`: Python string methods through minijinja-contrib's pycompat
//! (`.startswith`, `.split`, `.strip`, …), `raise_exception`, `strftime_now`, and a `tojson`
//! that writes exactly what Python's `json.dumps(x, ensure_ascii=False)` writes (`", "` and
//! `": "` separators, no HTML escaping, keys in their given order).

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{Environment, Error as JinjaError, ErrorKind, Value};
use serde::Serialize;

use crate::error::{Error, Result};

const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template plus the special tokens it may refer to.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Extra template variables, as `apply_chat_template(..., **kwargs)` passes them (e.g.
    /// Qwen3's `enable_thinking`); the standard variables take precedence.
    kwargs: serde_json::Map<String, serde_json::Value>,
}

/// What one render call gets: the OpenAI-format messages, optional tool schemas.
#[derive(Debug, Clone, Copy)]
pub struct RenderRequest<'a> {
    /// OpenAI-format messages (role, content, tool_calls, …).
    pub messages: &'a [serde_json::Value],
    /// OpenAI-format tool schemas, or `None`.
    pub tools: Option<&'a serde_json::Value>,
    /// Append the assistant header that starts a generation.
    pub add_generation_prompt: bool,
}

impl ChatTemplate {
    /// Compiles `source` (the Jinja text of `chat_template`); the tokens fill `bos_token` and
    /// `eos_token` in the template's context.
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| Error::Tokenize(format!("chat template syntax config: {e}")))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", python_tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| Error::Tokenize(format!("chat template does not compile: {e:#}")))?;
        Ok(Self { env, bos_token, eos_token, kwargs: serde_json::Map::new() })
    }

    /// Sets the extra template variables (`chat_template_kwargs`), so the training render equals
    /// what the sampler rendered with the same kwargs.
    pub fn set_kwargs(&mut self, kwargs: serde_json::Map<String, serde_json::Value>) {
        self.kwargs = kwargs;
    }

    /// The end-of-sequence token text (`eos_token` of tokenizer_config.json), if any.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Renders messages to the text the model sees.
    pub fn render(&self, request: RenderRequest<'_>) -> Result<String> {
        let conversation = PreparedConversation::new(request.messages, request.tools);
        self.render_prefix(&conversation, conversation.len(), request.add_generation_prompt)
    }

    /// Renders the first `len` messages of a prepared conversation.
    pub fn render_prefix(
        &self,
        conversation: &PreparedConversation,
        len: usize,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template =
            self.env.get_template(TEMPLATE_NAME).map_err(|e| Error::Tokenize(format!("chat template: {e}")))?;
        let context = minijinja::context! {
            messages => Value::from(conversation.messages[..len].to_vec()),
            tools => conversation.tools.clone(),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
            ..Value::from(Serde(&self.kwargs))
        };
        template.render(context).map_err(|e| Error::Tokenize(format!("rendering the chat template failed: {e:#}")))
    }
}

/// Messages and tools converted once into template values (shared, cheap to slice), so that
/// the many prefix renders of one conversation do not convert them again.
#[derive(Debug, Clone)]
pub struct PreparedConversation {
    messages: Vec<Value>,
    roles: Vec<Option<String>>,
    tools: Option<Value>,
}

impl PreparedConversation {
    /// Normalizes and converts `messages` and `tools` (see [`normalize_message`]).
    pub fn new(messages: &[serde_json::Value], tools: Option<&serde_json::Value>) -> Self {
        Self {
            messages: messages.iter().map(|m| Value::from(Serde(normalize_message(m)))).collect(),
            roles: messages.iter().map(|m| m.get("role").and_then(|r| r.as_str()).map(str::to_string)).collect(),
            tools: tools.filter(|t| !t.is_null()).map(|t| Value::from(Serde(t))),
        }
    }

    /// Number of messages.
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    /// True when there are no messages.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// The `role` of message `index`.
    pub fn role(&self, index: usize) -> Option<&str> {
        self.roles.get(index)?.as_deref()
    }
}

/// Makes a message safe for templates that treat `content` as a string: `null` content becomes
/// `""` (OpenAI sends null next to tool calls; Python Jinja would fail on `'x' in None`), and a
/// list of text parts becomes their concatenated text. The sampler's `token_ids` and `logprobs`
/// are dropped: no template reads them, and they would be copied into every prefix render.
fn normalize_message(message: &serde_json::Value) -> serde_json::Value {
    let mut message = message.clone();
    if let Some(obj) = message.as_object_mut() {
        obj.remove("token_ids");
        obj.remove("logprobs");
        let content = obj.get("content").cloned().unwrap_or(serde_json::Value::Null);
        let text = match content {
            serde_json::Value::Null => Some(String::new()),
            serde_json::Value::Array(parts) if parts.iter().all(is_text_part) => {
                Some(parts.iter().filter_map(|p| p.get("text")?.as_str()).collect::<String>())
            }
            _ => None,
        };
        if let Some(text) = text {
            obj.insert("content".into(), serde_json::Value::String(text));
        }
    }
    message
}

fn is_text_part(part: &serde_json::Value) -> bool {
    part.get("type").and_then(|t| t.as_str()) == Some("text") && part.get("text").is_some_and(|t| t.is_string())
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent)`.
fn python_tojson(value: &Value, kwargs: minijinja::value::Kwargs) -> std::result::Result<Value, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let written = match indent {
        Some(width) => {
            let spaces = vec![b' '; width];
            let mut ser = serde_json::Serializer::with_formatter(
                &mut out,
                serde_json::ser::PrettyFormatter::with_indent(&spaces),
            );
            value.serialize(&mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonJsonFormatter);
            value.serialize(&mut ser)
        }
    };
    written.map_err(|e| JinjaError::new(ErrorKind::BadSerialization, format!("tojson: {e}")))?;
    let text = String::from_utf8(out).map_err(|e| JinjaError::new(ErrorKind::BadSerialization, e.to_string()))?;
    Ok(Value::from_safe_string(text))
}

/// serde_json formatter with Python's default separators `", "` and `": "`.
struct PythonJsonFormatter;

impl serde_json::ser::Formatter for PythonJsonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

fn raise_exception(message: String) -> std::result::Result<Value, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, format!("the chat template refused the input: {message}")))
}

fn strftime_now(format: String) -> String {
    chrono::Local::now().format(&format).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(source: &str, messages: serde_json::Value) -> Result<String> {
        let template = ChatTemplate::new(source, Some("<s>".into()), Some("</s>".into()))?;
        let messages = messages.as_array().unwrap().clone();
        template.render(RenderRequest { messages: &messages, tools: None, add_generation_prompt: false })
    }

    #[test]
    fn tojson_writes_python_json_dumps_output() {
        let out = render(
            "{{ messages[0].args | tojson }}",
            json!([{"role": "user", "args": {"b": "<it's> é", "a": [1, 2.5, null, true]}}]),
        )
        .unwrap();
        assert_eq!(out, r#"{"b": "<it's> é", "a": [1, 2.5, null, true]}"#);
    }

    #[test]
    fn python_string_methods_and_raise_exception_work() {
        let source = "{% for m in messages %}{% if not m.content.startswith('x') %}{{ raise_exception('bad ' + m.role) }}{% endif %}{{ m.content.split('-')[-1] | upper }}{% endfor %}";
        assert_eq!(render(source, json!([{"role": "user", "content": "x-ok"}])).unwrap(), "OK");
        let err = render(source, json!([{"role": "user", "content": "y"}])).unwrap_err();
        assert!(err.to_string().contains("bad user"), "{err}");
    }

    #[test]
    fn null_content_and_text_parts_become_strings_and_sampler_ids_are_dropped() {
        let source = "{% for m in messages %}[{{ m.content }}{{ m.token_ids }}]{% endfor %}";
        let out = render(
            source,
            json!([{"role": "assistant", "content": null, "token_ids": [1]}, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]),
        )
        .unwrap();
        assert_eq!(out, "[][ab]");
    }

    #[test]
    fn blocks_are_trimmed_like_transformers() {
        let source = "{% for m in messages %}\n    {{- m.content }}\n{% endfor %}\n";
        assert_eq!(
            render(source, json!([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])).unwrap(),
            "a\nb\n"
        );
    }
}
