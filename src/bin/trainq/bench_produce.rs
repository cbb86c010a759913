//! `trainq bench produce`: a producer that streams agent-like groups into a model's queue while
//! a worker trains, for end-to-end runs (ops/gpu.sh e2e). Each trajectory is a multi-turn chat
//! with tool calls whose assistant turns carry the sampler's `token_ids` and `logprobs`, of a
//! length drawn log-uniformly from [--doc-min, --doc-max] tokens; each group's `policy_version`
//! is the model's latest checkpoint when the group is written.
//!
//! With `--sync` (async weight syncing off) it writes one step's groups at the current version,
//! then waits for the next checkpoint, as an on-policy producer fleet does; without, it keeps
//! `--ahead` steps' worth of groups pending at all times.

use std::time::Duration;

use anyhow::Result;
use clap::Args;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use trainq_queue::db::groups::{count_pending, submit_groups, NewGroup};
use trainq_queue::db::models::get_model;

use super::database::DatabaseArgs;

/// Vocabulary of the generated Qwen3-style ids: the byte-level BPE's regular tokens.
const REGULAR_TOKENS: i64 = 151_643;
/// Words of the user and tool texts (each about one token with its leading space).
const WORDS: [&str; 16] = [
    "the", "file", "search", "result", "line", "error", "value", "test", "build", "query", "table", "row", "path",
    "config", "output", "data",
];

/// Settings of `trainq bench produce`.
#[derive(Args, Debug)]
pub(crate) struct ProduceArgs {
    #[command(flatten)]
    db: DatabaseArgs,
    /// Model to feed.
    #[arg(long)]
    model: String,
    /// Groups per step (match the worker's groups_per_step).
    #[arg(long, default_value_t = 32)]
    groups_per_step: usize,
    /// Trajectories per group.
    #[arg(long, default_value_t = 8)]
    group_size: usize,
    /// Stop once the model has committed this many steps.
    #[arg(long, default_value_t = 50)]
    steps: i64,
    /// On-policy producers: write a step's groups at the current version, then wait for the
    /// next checkpoint (the worker runs without --async-weight-syncing).
    #[arg(long)]
    sync: bool,
    /// Without --sync: steps' worth of groups kept pending ahead of the worker.
    #[arg(long, default_value_t = 2)]
    ahead: usize,
    /// Shortest trajectory, in tokens.
    #[arg(long, default_value_t = 300)]
    doc_min: i64,
    /// Longest trajectory, in tokens.
    #[arg(long, default_value_t = 6000)]
    doc_max: i64,
    /// Seed of the generated trajectories.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

pub(crate) fn run(args: ProduceArgs) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(produce(args))
}

async fn produce(args: ProduceArgs) -> Result<()> {
    let pool = args.db.connect(2).await?;
    let mut rng = StdRng::seed_from_u64(args.seed);
    let mut written = 0usize;
    let mut last_version = -1;
    loop {
        let version = get_model(&pool, &args.model).await?.current_step.get();
        if version >= args.steps {
            break;
        }
        let pending = count_pending(&pool, &args.model).await? as usize;
        let due = if args.sync {
            if version == last_version {
                0
            } else {
                args.groups_per_step
            }
        } else {
            (args.ahead * args.groups_per_step).saturating_sub(pending)
        };
        if due > 0 {
            let groups: Vec<NewGroup> = (0..due).map(|_| group(&mut rng, &args, version)).collect();
            submit_groups(&pool, &groups).await?;
            written += due;
            last_version = version;
            eprintln!("produce: {due} group(s) at policy_version {version} ({written} in all, {pending} were pending)");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!("{}", json!({"produced_groups": written, "model": args.model, "steps": args.steps}));
    Ok(())
}

fn group(rng: &mut StdRng, args: &ProduceArgs, version: i64) -> NewGroup {
    let trajectories: Vec<Value> = (0..args.group_size)
        .map(|i| {
            let (lo, hi) = ((args.doc_min.max(64) as f64).ln(), (args.doc_max.max(args.doc_min) as f64).ln());
            let tokens = rng.gen_range(lo..=hi).exp() as i64;
            // Rewards spread within the group (never all equal), as a grader would give.
            let reward = ((i % 4) as f64) / 3.0;
            trajectory(rng, tokens, reward)
        })
        .collect();
    NewGroup {
        model: args.model.clone(),
        trajectories: Value::Array(trajectories),
        policy_version: Some(trainq_queue::StepNumber(version)),
        metadata: json!({"source": "trainq bench produce"}),
    }
}

/// A system prompt, a user task, 1–4 tool calls with their results, and a final answer: about
/// `tokens` tokens, half of them in the assistant turns (the sampler's ids and log-probs).
fn trajectory(rng: &mut StdRng, tokens: i64, reward: f64) -> Value {
    let calls = rng.gen_range(1..=4);
    let assistant_budget = (tokens / 2).max(8 * (calls + 1));
    let text_budget = (tokens - assistant_budget).max(20);
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent. Use the tools to inspect the repository."}),
        json!({"role": "user", "content": words(rng, text_budget / (calls + 1))}),
    ];
    for call in 0..calls {
        let ids = sampled(rng, assistant_budget / (calls + 1));
        messages.push(json!({
            "role": "assistant", "content": "",
            "tool_calls": [{"id": format!("call_{call}"), "type": "function",
                            "function": {"name": "search", "arguments": {"query": words(rng, 4)}}}],
            "token_ids": ids.0, "logprobs": ids.1,
        }));
        messages.push(json!({"role": "tool", "tool_call_id": format!("call_{call}"), "content": words(rng, text_budget / (calls + 1))}));
    }
    let answer = sampled(rng, assistant_budget / (calls + 1));
    messages.push(json!({"role": "assistant", "content": words(rng, 8), "token_ids": answer.0, "logprobs": answer.1}));
    json!({
        "messages": messages,
        "tools": [{"type": "function", "function": {"name": "search", "description": "Search the repository",
                   "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}],
        "reward": reward,
    })
}

/// `n` sampled ids and their log-probs (near a random-weight model's, −ln 151936 ≈ −11.9).
fn sampled(rng: &mut StdRng, n: i64) -> (Vec<i64>, Vec<f64>) {
    let ids = (0..n.max(1)).map(|_| rng.gen_range(0..REGULAR_TOKENS)).collect();
    let logprobs = (0..n.max(1)).map(|_| -11.9 + rng.gen_range(-0.5..0.5)).collect();
    (ids, logprobs)
}

fn words(rng: &mut StdRng, n: i64) -> String {
    (0..n.max(1)).map(|_| WORDS[rng.gen_range(0..WORDS.len())]).collect::<Vec<_>>().join(" ")
}
