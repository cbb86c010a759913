//! Queue benchmark (not a test): submit throughput against raw INSERT of the same bytes, and
//! claim + complete throughput. Creates and drops its own database on $DATABASE_URL's server.
//!
//!     source ~/.cache/trainq/env.sh && cargo run --example queue_bench [-- --help]
//!
//! Prints a markdown table; ops/bench/RESULTS.md keeps the numbers of this machine.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tokio::sync::Barrier;
use trainq_queue::db::{self, ClaimParams, StepRecord};
use trainq_queue::rl::{SkipReason, SkippedGroup};

/// Queue benchmark.
#[derive(Parser, Debug)]
struct Args {
    /// Concurrent producers.
    #[arg(long, default_value_t = 8)]
    producers: usize,
    /// Groups each producer submits.
    #[arg(long, default_value_t = 400)]
    groups_per_producer: usize,
    /// Trajectories per group.
    #[arg(long, default_value_t = 8)]
    group_size: usize,
    /// Concurrent claiming workers.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Groups per claim.
    #[arg(long, default_value_t = 32)]
    batch: i64,
    /// Disable a trigger of trainq.groups for the run (diagnosis: groups_notify, groups_validate).
    #[arg(long)]
    disable_trigger: Vec<String>,
    /// Small groups preloaded for the claim benchmark.
    #[arg(long, default_value_t = 40_000)]
    claim_groups: i64,
}

/// A trajectory of about 2 KB of JSON.
fn trajectory(i: usize, reward: f64) -> serde_json::Value {
    json!({
        "messages": [
            {"role": "system", "content": "You are a careful assistant that shows its work."},
            {"role": "user", "content": format!("Problem {i}: {}", "a long word problem about trains and apples. ".repeat(20))},
            {"role": "assistant", "content": format!("Let us reason step by step. {}", "First we add, then we divide. ".repeat(26))}
        ],
        "reward": reward,
        "metrics": {"turns": 1}
    })
}

fn group_text(seed: usize, size: usize) -> String {
    let items: Vec<_> = (0..size).map(|i| trajectory(seed + i, ((seed + i) % 3) as f64 / 2.0)).collect();
    serde_json::Value::Array(items).to_string()
}

/// Each producer inserts its groups one statement at a time; returns groups per second.
async fn insert_rate(pool: &PgPool, sql: &'static str, args: &Args, payloads: &Arc<Vec<String>>) -> f64 {
    let barrier = Arc::new(Barrier::new(args.producers + 1));
    let mut tasks = Vec::new();
    for p in 0..args.producers {
        let (pool, barrier, payloads, n) = (pool.clone(), barrier.clone(), payloads.clone(), args.groups_per_producer);
        tasks.push(tokio::spawn(async move {
            let mut conn = pool.acquire().await.unwrap();
            barrier.wait().await;
            for i in 0..n {
                let body = &payloads[(p * n + i) % payloads.len()];
                sqlx::query(sql).bind("bench").bind(body).execute(&mut *conn).await.unwrap();
            }
        }));
    }
    barrier.wait().await;
    let started = Instant::now();
    for t in tasks {
        t.await.unwrap();
    }
    (args.producers * args.groups_per_producer) as f64 / started.elapsed().as_secs_f64()
}

fn step_record(step: i64, worker: usize, claimed: usize) -> StepRecord {
    let now = chrono::Utc::now();
    StepRecord {
        model: "bench".into(),
        step: trainq_queue::StepNumber(step),
        worker_id: format!("w{worker}"),
        async_weight_syncing: false,
        started_at: now,
        finished_at: now,
        groups_claimed: claimed as i32,
        groups_trained: claimed as i32,
        groups_skipped: json!({}),
        trajectories: 0,
        tokens: 0,
        loss: None,
        loss_parts: json!({}),
        grad_norm: None,
        learning_rate: None,
        reward_mean: None,
        reward_std_mean: None,
        policy_lag_min: None,
        policy_lag_max: None,
        timings: json!({}),
        devices: json!([]),
        checkpoint_uri: None,
        checkpoint_sha256: None,
        groups_wanted: None,
        reward_mean_claimed: None,
        reward_mean_skipped: None,
        logprob_coverage: None,
        importance_ratio_mean: None,
    }
}

/// How a benchmark worker completes its claimed batch.
#[derive(Clone, Copy, PartialEq)]
enum Completion {
    /// `commit_step`: mark trained, insert the step row, advance current_step, NOTIFY.
    CommitStep,
    /// `skip_groups`: mark skipped (zero_variance), fenced.
    Skip,
}

/// Workers claim `batch` groups and complete them until none are pending; groups/s.
async fn claim_complete_rate(pool: &PgPool, args: &Args, next_step: &Arc<AtomicI64>, how: Completion) -> (f64, i64) {
    let barrier = Arc::new(Barrier::new(args.workers + 1));
    let mut tasks = Vec::new();
    for w in 0..args.workers {
        let (pool, barrier, next_step, batch) = (pool.clone(), barrier.clone(), next_step.clone(), args.batch);
        tasks.push(tokio::spawn(async move {
            let params = ClaimParams {
                model: "bench".into(),
                worker_id: format!("w{w}"),
                limit: batch,
                lease_seconds: 600.0,
                now: None,
                window: None,
            };
            barrier.wait().await;
            let mut done = 0i64;
            loop {
                let claim = db::claim_groups(&pool, &params).await.unwrap();
                if claim.groups.is_empty() {
                    return done;
                }
                let ids: Vec<_> = claim.groups.iter().map(|g| g.id).collect();
                if how == Completion::Skip {
                    let skips: Vec<_> = ids
                        .iter()
                        .map(|id| SkippedGroup {
                            id: *id,
                            reason: SkipReason::ZeroVariance,
                            std: Some(0.0),
                            detail: None,
                        })
                        .collect();
                    db::skip_groups(&pool, claim.token, &skips).await.unwrap();
                } else {
                    let step = step_record(next_step.fetch_add(1, Ordering::SeqCst), w, ids.len());
                    db::commit_step(&pool, &step, None, claim.token, &ids, &[]).await.unwrap();
                }
                done += ids.len() as i64;
            }
        }));
    }
    barrier.wait().await;
    let started = Instant::now();
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    (total as f64 / started.elapsed().as_secs_f64(), total)
}

async fn insert_small_groups(pool: &PgPool, n: i64) {
    sqlx::query("INSERT INTO trainq.groups (model, trajectories) SELECT 'bench', $1 FROM generate_series(1, $2)")
        .bind(json!([{"prompt_ids": [1, 2, 3], "completion_ids": [4, 5], "reward": 0}, {"prompt_ids": [1, 2, 3], "completion_ids": [6], "reward": 1}]))
        .bind(n)
        .execute(pool)
        .await
        .unwrap();
}

async fn fresh_database(admin: &PgPool, base: &url::Url, name: &str) -> PgPool {
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(admin).await.unwrap();
    let mut url = base.clone();
    url.set_path(name);
    PgPoolOptions::new().max_connections(16).connect(url.as_str()).await.unwrap()
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let base = url::Url::parse(&std::env::var("DATABASE_URL").expect("DATABASE_URL")).unwrap();
    let admin = PgPool::connect(base.as_str()).await.unwrap();
    let name = format!("trainq_bench_{}", uuid::Uuid::now_v7().simple());
    let pool = fresh_database(&admin, &base, &name).await;
    trainq_queue::migrate(&pool).await.unwrap();
    db::create_model(&pool, &db::NewModel::new("bench", "/base")).await.unwrap();
    sqlx::query(
        "CREATE TABLE bench_raw (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), model text, trajectories jsonb)",
    )
    .execute(&pool)
    .await
    .unwrap();
    for trigger in &args.disable_trigger {
        sqlx::query(&format!("ALTER TABLE trainq.groups DISABLE TRIGGER {trigger}")).execute(&pool).await.unwrap();
    }
    let payloads: Arc<Vec<String>> = Arc::new((0..64).map(|s| group_text(s * 100, args.group_size)).collect());
    let avg_bytes = payloads.iter().map(String::len).sum::<usize>() / payloads.len();

    let raw =
        insert_rate(&pool, "INSERT INTO bench_raw (model, trajectories) VALUES ($1, $2::jsonb)", &args, &payloads)
            .await;
    let submit =
        insert_rate(&pool, "INSERT INTO trainq.groups (model, trajectories) VALUES ($1, $2::jsonb)", &args, &payloads)
            .await;
    let next_step = Arc::new(AtomicI64::new(1));
    let (big_claim, big_n) = claim_complete_rate(&pool, &args, &next_step, Completion::CommitStep).await;
    let mut small = Vec::new();
    for how in [Completion::CommitStep, Completion::Skip] {
        insert_small_groups(&pool, args.claim_groups).await;
        small.push(claim_complete_rate(&pool, &args, &next_step, how).await);
    }
    pool.close().await;
    sqlx::query(&format!("DROP DATABASE {name} WITH (FORCE)")).execute(&admin).await.unwrap();

    let n = args.producers * args.groups_per_producer;
    println!("| measurement | groups | rate (groups/s) |");
    println!("|---|---:|---:|");
    println!("| raw INSERT into a plain jsonb table, {} producers, {} trajectories/group, {avg_bytes} B/group | {n} | {raw:.0} |", args.producers, args.group_size);
    println!(
        "| INSERT INTO trainq.groups (validated), same producers and bytes | {n} | {submit:.0} ({:.0}% of raw) |",
        100.0 * submit / raw
    );
    println!(
        "| claim {} + commit_step, {} workers, those {avg_bytes} B groups | {big_n} | {big_claim:.0} |",
        args.batch, args.workers
    );
    println!(
        "| claim {} + commit_step, {} workers, small 2-trajectory groups | {} | {:.0} |",
        args.batch, args.workers, small[0].1, small[0].0
    );
    println!(
        "| claim {} + skip_groups, {} workers, small 2-trajectory groups | {} | {:.0} |",
        args.batch, args.workers, small[1].1, small[1].0
    );
}
