//! kill -9 of the real `trainq worker` at seeded random moments over a real run (CPU, the demo's
//! tiny model, a file:// store, async weight syncing so a step's upload and commit overlap the
//! next one), restarting it each time, then checking what must hold whatever the moments were:
//! every group final exactly once, steps contiguous from 1, and every committed checkpoint whole
//! against its manifest and the sha256 its commit recorded.
//!
//! The seed comes from `TRAINQ_KILL_SEED` (default: the clock) and every failure prints it:
//! `TRAINQ_KILL_SEED=<seed> cargo test --test worker_kill_random` replays the same moments.

mod common;
mod worker_support;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, SystemTime};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use trainq_queue::db::steps::list_steps;
use trainq_queue::storage::{complete_steps, fetch_checkpoint, FetchOptions, Store};
use trainq_queue::StepNumber;

use common::db::TestDb;
use worker_support::{build_model, register, submit, tiny_config, WorkerProcess};

/// Groups submitted (two per step: 32 steps when nothing is short; a step takes a few hundred
/// milliseconds on the CPU, so the kills land across the whole run).
const GROUPS: usize = 64;
/// Workers killed before the last one is left to finish.
const KILLS: usize = 8;
/// Lease of a claim: a killed worker's groups are back after it.
const LEASE_SECONDS: i64 = 3;
const START_LIMIT: Duration = Duration::from_secs(60);
const FINISH_LIMIT: Duration = Duration::from_secs(240);

fn seed() -> u64 {
    match std::env::var("TRAINQ_KILL_SEED") {
        Ok(text) => text.parse().expect("TRAINQ_KILL_SEED is a number"),
        Err(_) => SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_millis() as u64,
    }
}

/// One committed checkpoint row.
#[derive(Debug, sqlx::FromRow)]
struct CheckpointRow {
    step: StepNumber,
    uri: String,
    sha256: String,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_nine_at_random_moments_loses_and_doubles_nothing() {
    let seed = seed();
    eprintln!("worker_kill_random: TRAINQ_KILL_SEED={seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let db = TestDb::new().await;
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    let mut cfg = tiny_config(2, LEASE_SECONDS);
    // Every group stays eligible across the run's steps; kills may hit one group many times.
    cfg.queue.async_weight_syncing = true;
    cfg.queue.max_staleness = 40;
    cfg.queue.max_attempts = 50;
    cfg.queue.retry_backoff_seconds = 0.1;
    register(&db.pool, "m", &model_dir, cfg).await;
    let rewards: Vec<Vec<f64>> = (0..GROUPS).map(|i| vec![0.0, 1.0, (i % 3) as f64 / 2.0]).collect();
    let rewards: Vec<&[f64]> = rewards.iter().map(Vec::as_slice).collect();
    submit(&db.pool, "m", &rewards, Some(0)).await;
    let root = work.path().join("store");
    std::fs::create_dir_all(&root).unwrap();
    let store_url = format!("file://{}", root.display());
    let url = db.url(None);
    let args = ["--keep-last", "60", "--stop-when-idle", "10"];

    let mut moments = Vec::new();
    for round in 0..KILLS {
        let dir = work.path().join(format!("w{round}"));
        let mut worker = WorkerProcess::spawn(&url, "m", &store_url, None, &dir, &[], &args);
        // A quarter of the kills land during start-up, the rest while it claims, trains, uploads, commits.
        let delay = if rng.gen_bool(0.25) {
            Duration::from_millis(rng.gen_range(0..1500))
        } else {
            worker.wait_for_line("worker ready", START_LIMIT);
            Duration::from_millis(rng.gen_range(0..2000))
        };
        // The fault's moment, not a wait for a result.
        tokio::time::sleep(delay).await;
        worker.kill9();
        let steps = committed(&db).await;
        moments.push(format!("round {round}: killed {delay:?} in, {steps} step(s) committed"));
    }
    eprintln!("{}", moments.join("\n"));
    let mut last = WorkerProcess::spawn(&url, "m", &store_url, None, &work.path().join("last"), &[], &args);
    let exited = last.wait_exit(FINISH_LIMIT);
    let context = format!("TRAINQ_KILL_SEED={seed}\n{}\nlast worker:\n{}", moments.join("\n"), last.seen.join("\n"));
    assert!(exited, "{context}");
    check_invariants(&db, &store_url, work.path(), &context).await;
}

async fn committed(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM trainq.steps").fetch_one(&db.pool).await.unwrap()
}

async fn check_invariants(db: &TestDb, store_url: &str, work: &Path, context: &str) {
    // Every group is final, and a trained one belongs to exactly one committed step.
    let rows: Vec<(String, Option<i64>)> =
        sqlx::query_as("SELECT state::text, step FROM trainq.groups").fetch_all(&db.pool).await.unwrap();
    assert_eq!(rows.len(), GROUPS, "{context}");
    let mut trained_per_step: BTreeMap<i64, i32> = BTreeMap::new();
    for (state, step) in &rows {
        match (state.as_str(), step) {
            ("trained", Some(step)) => *trained_per_step.entry(*step).or_default() += 1,
            ("skipped" | "failed", None) => {}
            other => panic!("group not final once: {other:?}\n{context}"),
        }
    }
    // Steps run 1..=N without gaps, each counting exactly its groups; the model stands at N.
    let mut steps = list_steps(&db.pool, "m", 1000).await.unwrap();
    steps.reverse();
    let numbers: Vec<i64> = steps.iter().map(|s| s.step.get()).collect();
    assert_eq!(numbers, (1..=steps.len() as i64).collect::<Vec<_>>(), "{context}");
    let recorded: BTreeMap<i64, i32> = steps.iter().map(|s| (s.step.get(), s.groups_trained)).collect();
    assert_eq!(recorded, trained_per_step, "{context}");
    let current: i64 = sqlx::query_scalar("SELECT current_step FROM trainq.models").fetch_one(&db.pool).await.unwrap();
    assert_eq!(current, steps.len() as i64, "{context}");
    // Every committed checkpoint is whole: each file matches the manifest, and the manifest is
    // the one the commit recorded. The store holds complete checkpoints of committed steps only.
    let checkpoints: Vec<CheckpointRow> =
        sqlx::query_as("SELECT step, uri, sha256 FROM trainq.checkpoints ORDER BY step")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(checkpoints.len(), steps.len(), "{context}");
    let store = Store::open(store_url).unwrap();
    for (row, step) in checkpoints.iter().zip(&steps) {
        assert_eq!(Some(&row.sha256), step.checkpoint_sha256.as_ref(), "step {}: {context}", row.step);
        assert_eq!(row.uri, format!("{store_url}/m/checkpoints/{:06}/", row.step), "{context}");
        let options = FetchOptions { expected_manifest_sha256: Some(row.sha256.clone()), ..FetchOptions::default() };
        let to = work.join(format!("fetched-{:06}", row.step));
        if let Err(err) = fetch_checkpoint(&store, "m", row.step, &to, &options, &|_| {}).await {
            panic!("step {} is not whole: {err}\n{context}", row.step);
        }
    }
    let in_store: Vec<i64> = complete_steps(&store, "m").await.unwrap().into_iter().map(|s| s.get()).collect();
    assert_eq!(in_store, numbers, "{context}");
}
