//! Our chat tokenization of a multi-turn tool-calling conversation equals transformers'
//! `apply_chat_template` with the real Qwen3 tokenizer, token for token, with the right
//! assistant mask (reference: tests/reference/chat_template_ref.py run with $TRAINQ_PYTHON).

use std::path::PathBuf;
use std::process::Command;

use serde_json::{json, Value};
use trainq_engine::tokenize::{ChatTokenizer, TokenizeError, Trajectory};

fn qwen3_dir() -> PathBuf {
    PathBuf::from(
        std::env::var("TRAINQ_QWEN3_TOKENIZER").expect("TRAINQ_QWEN3_TOKENIZER is set by ops/setup.sh's env file"),
    )
}

/// Two tools, parallel tool calls with string and object arguments, tool results, non-ASCII,
/// four assistant turns over two user queries, `reasoning_content` on two of them (Qwen3 renders
/// it only after the last user query, so prefix renders differ from the full one there).
fn conversation() -> Value {
    serde_json::from_str(include_str!("fixtures/chat_tool_conversation.json")).unwrap()
}

/// Runs the transformers reference on `conv`: (rendered text, ids, assistant mask).
fn reference(conv: &Value) -> (String, Vec<i64>, Vec<bool>) {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("conversation.json");
    let output = dir.path().join("reference.json");
    std::fs::write(&input, conv.to_string()).unwrap();
    let python = std::env::var("TRAINQ_PYTHON").expect("TRAINQ_PYTHON is set by ops/setup.sh's env file");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/reference/chat_template_ref.py");
    let status = Command::new(python).arg(script).arg(qwen3_dir()).arg(&input).arg(&output).status().unwrap();
    assert!(status.success(), "chat_template_ref.py failed");
    let out: Value = serde_json::from_str(&std::fs::read_to_string(output).unwrap()).unwrap();
    let ids = serde_json::from_value(out["ids"].clone()).unwrap();
    let mask = serde_json::from_value(out["mask"].clone()).unwrap();
    (out["text"].as_str().unwrap().to_string(), ids, mask)
}

#[test]
fn a_multi_turn_tool_conversation_matches_transformers_token_for_token() {
    let tokenizer = ChatTokenizer::from_dir(&qwen3_dir()).unwrap();
    let conv = conversation();
    let (ref_text, ref_ids, ref_mask) = reference(&conv);
    let messages = conv["messages"].as_array().unwrap().clone();
    let ours_text = tokenizer
        .render(trainq_engine::tokenize::RenderRequest {
            messages: &messages,
            tools: Some(&conv["tools"]),
            add_generation_prompt: false,
        })
        .unwrap();
    assert_eq!(ours_text, ref_text, "rendered text differs");
    let traj = Trajectory::from_json(&conv).unwrap();
    let ours = tokenizer.tokenize(&traj, 4096).unwrap();
    assert_eq!(ours.ids, ref_ids, "token ids differ");
    assert_eq!(ours.trained, ref_mask, "assistant mask differs");
    assert!(ours.trained_tokens() > 30 && ours.trained_tokens() < ours.len() / 2);
    assert!(ours.sampler_logprobs.iter().all(Option::is_none));
}

#[test]
fn sampler_token_ids_replace_their_turn_and_keep_their_logprobs() {
    let tokenizer = ChatTokenizer::from_dir(&qwen3_dir()).unwrap();
    let mut conv = conversation();
    let plain = tokenizer.tokenize(&Trajectory::from_json(&conv).unwrap(), 4096).unwrap();
    let sampled_text = "<think>\nEasy.\n</think>\n\n1 + 1 = 2.<|im_end|>";
    let sampled: Vec<i64> =
        tokenizer.tokenizer().encode(sampled_text, false).unwrap().get_ids().iter().map(|&i| i64::from(i)).collect();
    let logprobs: Vec<f32> = (0..sampled.len()).map(|i| -0.01 * i as f32).collect();
    let last = conv["messages"].as_array().unwrap().len() - 1;
    conv["messages"][last]["token_ids"] = json!(sampled);
    conv["messages"][last]["logprobs"] = json!(logprobs);
    let spliced = tokenizer.tokenize(&Trajectory::from_json(&conv).unwrap(), 4096).unwrap();

    // The template's last turn is "<think>\n\n</think>\n\n1 + 1 = 2.<|im_end|>" then "\n".
    let start = spliced.sampler_logprobs.iter().position(Option::is_some).unwrap();
    assert_eq!(spliced.ids[..start], plain.ids[..start], "everything before the turn is unchanged");
    assert_eq!(spliced.ids[start..start + sampled.len()], sampled[..]);
    assert!(spliced.trained[start..start + sampled.len()].iter().all(|t| *t));
    assert_eq!(spliced.sampler_logprobs[start + 1], Some(-0.01));
    assert_eq!(spliced.ids[start + sampled.len()..], plain.ids[plain.len() - 1..], "the trailing newline follows");
    assert!(!spliced.trained[spliced.len() - 1]);
}

#[test]
fn a_conversation_longer_than_max_seq_len_is_reported_not_truncated() {
    let tokenizer = ChatTokenizer::from_dir(&qwen3_dir()).unwrap();
    let traj = Trajectory::from_json(&conversation()).unwrap();
    let full = tokenizer.tokenize(&traj, 4096).unwrap().len();
    match tokenizer.tokenize(&traj, full - 1) {
        Err(TokenizeError::TooLong { tokens, max_seq_len }) => assert_eq!((tokens, max_seq_len), (full, full - 1)),
        other => panic!("expected TooLong, got {other:?}"),
    }
}

#[test]
fn sampler_ids_splice_cleanly_when_the_turn_starts_inside_a_header_token() {
    let tokenizer = ChatTokenizer::from_dir(&qwen3_dir()).unwrap();
    let encode = |text: &str| -> Vec<i64> {
        tokenizer.tokenizer().encode(text, false).unwrap().get_ids().iter().map(|&i| i64::from(i)).collect()
    };
    // An earlier turn whose content starts with "\n\n": Qwen3 renders "assistant\n" + "\n\nHello!",
    // and the three newlines become one token that straddles the start of the turn.
    let mut conv = json!({"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "\n\nHello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye!"}
    ]});
    let plain = tokenizer.tokenize(&Trajectory::from_json(&conv).unwrap(), 4096).unwrap();
    assert!(plain.ids.contains(&encode("\n\n\n")[0]) && encode("\n\n\n").len() == 1, "the straddling token exists");
    let sampled = encode("<think>\nok\n</think>\n\nHello!<|im_end|>");
    conv["messages"][1]["token_ids"] = json!(sampled);
    let spliced = tokenizer.tokenize(&Trajectory::from_json(&conv).unwrap(), 4096).unwrap();
    let prompt = encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    assert_eq!(spliced.ids[..prompt.len()], prompt[..], "the prompt is tokenized as the sampler saw it");
    assert!(spliced.trained[..prompt.len()].iter().all(|t| !t));
    assert_eq!(spliced.ids[prompt.len()..prompt.len() + sampled.len()], sampled[..]);
    assert!(spliced.trained[prompt.len()..prompt.len() + sampled.len()].iter().all(|t| *t));
    let rest =
        encode("\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nBye!<|im_end|>\n");
    assert_eq!(spliced.ids[prompt.len() + sampled.len()..], rest[..]);
}

#[test]
fn chat_template_kwargs_render_what_the_sampler_saw_with_enable_thinking_false() {
    let kwargs = json!({"enable_thinking": false});
    let tokenizer =
        ChatTokenizer::from_dir(&qwen3_dir()).unwrap().with_template_kwargs(kwargs.as_object().unwrap().clone());
    let conv = json!({"messages": [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "1 + 1 = 2."}
    ], "chat_template_kwargs": kwargs});
    let (ref_text, ref_ids, ref_mask) = reference(&conv);
    let traj = Trajectory::from_json(&conv).unwrap();
    let ours = tokenizer.tokenize(&traj, 4096).unwrap();
    assert_eq!(ours.ids, ref_ids, "token ids differ");
    assert_eq!(ours.trained, ref_mask, "assistant mask differs");
    let messages = conv["messages"].as_array().unwrap().clone();
    let request =
        trainq_engine::tokenize::RenderRequest { messages: &messages, tools: None, add_generation_prompt: true };
    let prompt = tokenizer.render(request).unwrap();
    assert!(prompt.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"), "{prompt:?}");
    assert!(ref_text.contains("<think>\n\n</think>\n\n1 + 1 = 2."), "{ref_text:?}");
    // The empty think block was part of the sampler's prompt: it is not trained. Without the
    // kwargs it would be (the sampler would have generated it).
    let trained: Vec<i64> = ours.ids.iter().zip(&ours.trained).filter(|(_, t)| **t).map(|(id, _)| *id).collect();
    let text = tokenizer.tokenizer().decode(&trained.iter().map(|&i| i as u32).collect::<Vec<_>>(), false).unwrap();
    assert_eq!(text, "1 + 1 = 2.<|im_end|>");
    let plain = ChatTokenizer::from_dir(&qwen3_dir()).unwrap().tokenize(&traj, 4096).unwrap();
    assert!(plain.trained_tokens() > ours.trained_tokens());
}
