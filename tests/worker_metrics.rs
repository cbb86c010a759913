//! The worker's Prometheus endpoint against real PostgreSQL: a scrape shows the steps the
//! worker committed and the model's queue as the database has it — the numbers `trainq status`
//! prints — and no GPU memory where there is no GPU.

mod common;

use std::sync::Arc;

use chrono::Utc;
use common::db::{insert_groups, TestDb};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use trainq::worker::metrics::{serve_metrics, WorkerMetrics};
use trainq_queue::db::StepRecord;
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

#[tokio::test]
async fn a_scrape_shows_committed_steps_and_the_queue_as_status_does() {
    let db = TestDb::new().await;
    db.create_model("m").await;
    insert_groups(&db.pool, "m", 3).await;
    let metrics = Arc::new(WorkerMetrics::new("m", vec!["cpu".into()]));
    metrics.observe_step(&step(1));
    metrics.observe_step(&step(2));
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
    assert_eq!(reqwest::get(format!("http://{addr}/other")).await.unwrap().status(), 404);
    stop.cancel();
}
