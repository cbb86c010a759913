//! The psycopg producer example (examples/producer.py) runs against a real database as a
//! `trainq_producer` member, via $TRAINQ_PYTHON.

mod common;

use common::db::{TestDb, TestRole};
use uuid::Uuid;

#[tokio::test]
async fn the_psycopg_example_submits_groups_and_sees_a_bad_one_refused() {
    let python = std::env::var("TRAINQ_PYTHON").expect("TRAINQ_PYTHON (source ~/.cache/trainq/env.sh)");
    let db = TestDb::new().await;
    db.create_model("m1").await;
    let producer = TestRole::new(&db, "py", "trainq_producer").await;
    let output = tokio::process::Command::new(python)
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/producer.py"))
        .args(["--model", "m1", "--groups", "3", "--policy-version", "0"])
        .env("DATABASE_URL", db.url(Some(&producer.name)))
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "producer.py failed: {stderr}");
    let out: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let ids: Vec<Uuid> = out["ids"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().parse().unwrap()).collect();
    assert_eq!(ids.len(), 4);
    assert_eq!(out["refused"]["sqlstate"], "TQ005");
    assert_eq!(out["refused"]["message"], "trajectory 1: field \"reward\" must be finite, got \"NaN\"");
    assert_eq!(out["latest_checkpoint"], serde_json::Value::Null);
    let stored: Vec<(Uuid, i32, Option<i64>, String)> =
        sqlx::query_as("SELECT id, reward_count, policy_version, submitted_by::text FROM trainq.groups ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(stored.iter().map(|r| r.0).collect::<Vec<_>>(), ids);
    assert!(stored.iter().all(|r| r.1 == 4 && r.2 == Some(0) && r.3 == producer.name));
}
