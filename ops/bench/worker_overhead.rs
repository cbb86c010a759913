//! Worker benchmark (not a test): the share of a step spent outside training (claim, filter +
//! tokenize + pack, checkpoint save, upload, commit) on the CPU with the demo's tiny model and
//! demo-sized groups, from the phase timings the worker records for each step. Creates its own
//! database `trainq_bench_worker` on $DATABASE_URL's server and a `file://` store (or the store
//! given with --store, e.g. an s3:// URL with AWS_* set).
//!
//!     source ~/.cache/trainq/env.sh && cargo run --example worker_overhead -- --steps 20
//!
//! Prints a markdown table; ops/bench/RESULTS.md keeps the numbers of this machine.

use std::time::Duration;

use clap::Parser;
use serde_json::json;
use sqlx::PgPool;
use tch::Device;
use tokio_util::sync::CancellationToken;
use trainq::worker::{run_worker, WorkerOptions};
use trainq_queue::config::{LoraConfig, TrainConfig};
use trainq_queue::db::groups::{submit_groups, NewGroup};
use trainq_queue::db::models::{create_model, NewModel};

const NAME: &str = "trainq_bench_worker";
const PHASES: [&str; 6] = ["claim", "prepare", "train", "save", "upload", "commit"];

/// Worker overhead benchmark.
#[derive(Parser, Debug)]
struct Args {
    /// PostgreSQL server URL (a database `trainq_bench_worker` is recreated there).
    #[arg(long, env = "DATABASE_URL", default_value = "postgres://postgres@127.0.0.1:5432/postgres")]
    database_url: String,
    /// Steps to time (one warm-up step more is run and left out).
    #[arg(long, default_value_t = 20)]
    steps: u64,
    /// Groups per step (the demo's default).
    #[arg(long, default_value_t = 8)]
    groups_per_step: usize,
    /// Trajectories per group (the demo's default).
    #[arg(long, default_value_t = 8)]
    group_size: usize,
    /// Checkpoint store; default a file:// store in a temporary directory.
    #[arg(long)]
    store: Option<String>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let url = trainq_queue::db::databases::recreate_database(&args.database_url, NAME).await?;
    let pool = PgPool::connect(&url).await?;
    trainq_queue::migrate(&pool).await?;
    let work = tempfile::tempdir()?;
    let model_dir = work.path().join("model");
    trainq::demo::run::build_tiny_model(&model_dir, 7)?;
    let mut cfg = TrainConfig {
        lora: Some(LoraConfig { rank: 8, alpha: 32.0, ..LoraConfig::default() }),
        max_seq_len: 64,
        max_tokens_per_micro_batch: 1024,
        ..TrainConfig::default()
    };
    cfg.queue.groups_per_step = args.groups_per_step;
    // The bench's trajectories carry no sampler log-probs.
    cfg.loss.allow_training_without_logprobs = true;
    cfg.queue.async_weight_syncing = true;
    cfg.queue.max_staleness = args.steps as i64 + 1;
    create_model(&pool, &NewModel { config: cfg, ..NewModel::new(NAME, model_dir.display().to_string()) }).await?;
    submit_all(&pool, &args).await?;

    let store = args.store.clone().unwrap_or_else(|| format!("file://{}", work.path().join("store").display()));
    let mut opts = WorkerOptions::new(NAME, &store, trainq::worker::Placement::One(Device::Cpu));
    opts.work_dir = work.path().join("worker");
    opts.max_steps = Some(args.steps + 1);
    // Retention must keep every checkpoint a producer may still sample from (max_staleness + 1).
    opts.retention.keep_last = args.steps as usize + 2;
    opts.poll_interval = Duration::from_millis(50);
    let summary = run_worker(&pool, &opts, CancellationToken::new()).await?;
    print_table(&summary.steps[1..], &args, &store);
    pool.close().await;
    Ok(())
}

/// Submits every step's groups up front: demo-shaped chats (a short prompt, an 8-character
/// answer), rewards varied within each group so that nothing is filtered out.
async fn submit_all(pool: &PgPool, args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let groups: Vec<NewGroup> = (0..(args.steps as usize + 1) * args.groups_per_step)
        .map(|g| {
            let prompt = trainq::demo::task::PROMPTS[g % trainq::demo::task::PROMPTS.len()];
            let trajectories = (0..args.group_size)
                .map(|i| {
                    json!({"messages": [
                        {"role": "user", "content": prompt},
                        {"role": "assistant", "content": format!("a{i}b{g}c d e")}
                    ], "reward": (i % 3) as f64 / 2.0})
                })
                .collect();
            NewGroup {
                model: NAME.into(),
                trajectories,
                policy_version: Some(trainq_queue::StepNumber(0)),
                metadata: json!({}),
            }
        })
        .collect();
    submit_groups(pool, &groups).await?;
    Ok(())
}

fn print_table(steps: &[trainq_queue::db::StepRecord], args: &Args, store: &str) {
    let n = steps.len() as f64;
    let mean = |phase: &str| steps.iter().map(|s| s.timings[phase].as_f64().unwrap_or(0.0)).sum::<f64>() / n;
    let total: f64 = PHASES.iter().map(|p| mean(p)).sum();
    println!(
        "worker overhead on {} steps ({} groups × {} trajectories, tiny demo model, CPU, store {})\n",
        steps.len(),
        args.groups_per_step,
        args.group_size,
        store.split("://").next().unwrap_or("?")
    );
    println!("| phase | mean ms / step | share of step |");
    println!("|---|---:|---:|");
    for phase in PHASES {
        println!("| {phase} | {:.1} | {:.1}% |", mean(phase) * 1e3, 100.0 * mean(phase) / total);
    }
    let outside = total - mean("train");
    println!("| **outside training** | {:.1} | **{:.1}%** |", outside * 1e3, 100.0 * outside / total);
    println!("| step total (sum of phases) | {:.1} | 100% |", total * 1e3);
    // Start to start of consecutive steps: also counts what no phase times (commit lock, loop
    // bookkeeping, retention, waiting for the next claim).
    let periods: Vec<f64> = steps
        .windows(2)
        .map(|w| (w[1].started_at - w[0].started_at).num_microseconds().unwrap_or(0) as f64 / 1e6)
        .collect();
    if !periods.is_empty() {
        let period = periods.iter().sum::<f64>() / periods.len() as f64;
        let untimed = period - total;
        println!(
            "| step period (start to next start) | {:.1} | untimed {:.1} ms = {:.1}% |",
            period * 1e3,
            untimed * 1e3,
            100.0 * untimed / period
        );
    }
}
