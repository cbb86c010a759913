//! The worker's Prometheus endpoint against real PostgreSQL: a scrape shows the steps and the
//! skipped passes the worker counted and the model's queue and skipped passes as the database
//! has them — the numbers `trainq status` prints — and no GPU memory where there is no GPU.

mod common;

use std::sync::Arc;

use chrono::Utc;
use common::db::{insert_groups, TestDb};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use trainq::worker::metrics::{serve_metrics, WorkerMetrics};
use trainq_queue::db::skipped_passes::{record_skipped_pass, SkippedPass};
use trainq_queue::db::{claim_groups, ClaimParams, StepRecord};
use trainq_queue::rl::{SkipReason, SkippedGroup};
use trainq_queue::StepNumber;

fn step(n: i64) -> StepRecord {
    let now = Utc::now();
    StepRecord {
        model: "m".into(),
        step: StepNumber(n),
        worker_id: "w".into(),
        async_weight_syncing: false,
        started_at: now,
        finished_at: now,
        groups_claimed: 4,
        groups_trained: 3,
        groups_skipped: json!({"zero_variance": 1}),
        trajectories: 6,
        tokens: 900,
        loss: None,
        loss_parts: json!({}),
        grad_norm: None,
        learning_rate: None,
        reward_mean: None,
        reward_std_mean: None,
        policy_lag_min: None,
        policy_lag_max: None,
        timings: json!({"claim": 0.01, "train": 0.3}),
        devices: json!(["cpu"]),
        checkpoint_uri: None,
        checkpoint_sha256: None,
        groups_wanted: None,
        reward_mean_claimed: None,
        reward_mean_skipped: None,
        logprob_coverage: None,
        importance_ratio_mean: None,
    }
}

/// Claims one group and records it as a pass whose every group was skipped, as the worker does.
async fn record_one_skipped_pass(db: &TestDb) {
    let params = ClaimParams {
        model: "m".into(),
        worker_id: "w".into(),
        limit: 1,
        lease_seconds: 60.0,
        now: None,
        window: None,
    };
    let claim = claim_groups(&db.pool, &params).await.unwrap();
    let skipped: Vec<SkippedGroup> = claim
        .groups
        .iter()
        .map(|g| SkippedGroup { id: g.id, reason: SkipReason::ZeroVariance, std: Some(0.0), detail: None })
        .collect();
    let pass = SkippedPass {
        model: "m".into(),
        current_step: StepNumber(0),
        worker_id: "w".into(),
        started_at: Utc::now(),
        groups_claimed: 1,
        groups_skipped: json!({"zero_variance": 1}),
        reward_mean_claimed: Some(0.5),
        reward_std_mean: Some(0.0),
    };
    record_skipped_pass(&db.pool, claim.token, &pass, &skipped).await.unwrap();
}

#[tokio::test]
async fn a_scrape_shows_committed_steps_and_the_queue_as_status_does() {
    let db = TestDb::new().await;
    db.create_model("m").await;
    insert_groups(&db.pool, "m", 4).await;
    record_one_skipped_pass(&db).await; // of one group: three stay pending
    let metrics = Arc::new(WorkerMetrics::new("m", vec!["cpu".into()]));
    metrics.observe_step(&step(1));
    metrics.observe_step(&step(2));
    metrics.observe_skipped_pass();
    let stop = CancellationToken::new();
    let addr = serve_metrics("127.0.0.1:0".parse().unwrap(), metrics, db.pool.clone(), stop.clone()).await.unwrap();

    let response = reqwest::get(format!("http://{addr}/metrics")).await.unwrap();
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    for line in [
        "trainq_steps_total{model=\"m\"} 2",
        "trainq_step_groups_total{model=\"m\",outcome=\"trained\"} 6",
        "trainq_step_groups_total{model=\"m\",outcome=\"skipped_zero_variance\"} 2",
        "trainq_step_phase_seconds_count{model=\"m\",phase=\"train\"} 2",
        "trainq_tokens_per_second{model=\"m\"} 3000",
        "trainq_groups{model=\"m\",state=\"pending\"} 3",
        "trainq_groups{model=\"m\",state=\"failed\"} 0",
        "trainq_model_step{model=\"m\"} 0",
        "trainq_skipped_passes_total{model=\"m\"} 1",
        "trainq_model_skipped_passes{model=\"m\"} 1",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    let oldest: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("trainq_oldest_pending_seconds{model=\"m\"} "))
        .expect("oldest pending age")
        .parse()
        .unwrap();
    assert!(oldest >= 0.0);
    assert!(!text.contains("trainq_gpu_memory_used_bytes{"), "absent, not faked, without a GPU");

    let status = std::process::Command::new(env!("CARGO_BIN_EXE_trainq"))
        .args(["status", "m"])
        .env("DATABASE_URL", db.url(None))
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&status.stdout);
    let row = out.lines().find(|l| l.starts_with("m ")).unwrap_or_else(|| panic!("{out}"));
    let columns: Vec<&str> = row.split_whitespace().collect();
    assert_eq!((columns[1], columns[2]), ("0", "3"), "step and pending as in the scrape: {row}");
    let header: Vec<&str> = out.lines().next().unwrap().split_whitespace().collect();
    let passes = header.iter().position(|h| *h == "SKIPPED_PASSES").unwrap_or_else(|| panic!("{out}"));
    assert_eq!(columns[passes], "1", "skipped passes as in the scrape: {out}");
    assert_eq!(reqwest::get(format!("http://{addr}/other")).await.unwrap().status(), 404);
    stop.cancel();
}
