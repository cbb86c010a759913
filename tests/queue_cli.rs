//! The `trainq` binary against a real database: migrate, model create|list|show, submit (good
//! lines go in, bad lines are reported with their line number and SQLSTATE), status, steps.

mod common;

use std::process::Output;

use common::db::{chat_group, TestDb};
use serde_json::json;

async fn trainq(db: &TestDb, args: &[&str]) -> Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_trainq"))
        .args(args)
        .env("DATABASE_URL", db.url(None))
        .env("RUST_LOG", "warn")
        .output()
        .await
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test]
async fn models_are_created_listed_and_shown_with_their_config() {
    let db = TestDb::new().await;
    let out = trainq(&db, &["migrate"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let latest = trainq_queue::db::MIGRATOR.iter().map(|m| m.version).max().expect("migrations embedded");
    let said = text(&out.stdout);
    assert!(said.contains(&format!("schema trainq is at migration {latest}")), "{said}");
    let out = trainq(
        &db,
        &[
            "model",
            "create",
            "qwen-small",
            "--base",
            "/models/qwen3",
            "--lora-rank",
            "16",
            "--async-weight-syncing",
            "--max-staleness",
            "2",
            "--max-group-trajectories",
            "32",
        ],
    )
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = trainq(&db, &["model", "create", "bad", "--base", "/b", "--lora-rank", "0"]).await;
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("lora.rank"), "{}", text(&out.stderr));
    let out = trainq(&db, &["model", "list"]).await;
    let listed = text(&out.stdout);
    assert!(listed.contains("qwen-small") && listed.contains("/models/qwen3") && !listed.contains("bad"), "{listed}");
    let out = trainq(&db, &["model", "show", "qwen-small"]).await;
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["config"]["lora"]["rank"], 16);
    assert_eq!(shown["config"]["queue"]["async_weight_syncing"], true);
    assert_eq!(shown["config"]["queue"]["max_staleness"], 2);
    assert_eq!(shown["max_group_trajectories"], 32);
    assert_eq!(shown["vocab_size"], serde_json::Value::Null, "no config.json at /models/qwen3: unknown");
    let out = trainq(&db, &["model", "show", "nope"]).await;
    assert!(!out.status.success() && text(&out.stderr).contains("unknown model \"nope\""));
    // The vocabulary size comes from the base's config.json (or --vocab-size) and is checked on insert.
    let base = tempfile::tempdir().unwrap();
    std::fs::write(base.path().join("config.json"), r#"{"model_type": "qwen3", "vocab_size": 151936}"#).unwrap();
    let out = trainq(&db, &["model", "create", "sized", "--base", base.path().to_str().unwrap()]).await;
    assert!(text(&out.stdout).contains("vocab_size 151936"), "{}", text(&out.stdout));
    let out = trainq(&db, &["model", "show", "sized"]).await;
    assert_eq!(serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["vocab_size"], 151936);
    let out = trainq(&db, &["model", "create", "given", "--base", "/b", "--vocab-size", "32"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let refused = sqlx::query(
        "INSERT INTO trainq.groups (model, trajectories) VALUES ('given', '[{\"prompt_ids\": [1], \"completion_ids\": [32], \"reward\": 1}]')",
    )
    .execute(&db.pool)
    .await
    .unwrap_err();
    assert_eq!(refused.as_database_error().unwrap().code().as_deref(), Some("TQ022"));
}

#[tokio::test]
async fn submit_stores_good_lines_and_reports_each_bad_line_with_its_number() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    let lines = [
        json!({"model": "m1", "trajectories": chat_group(&[0.0, 1.0]), "policy_version": 0}).to_string(),
        json!({"trajectories": chat_group(&[1.0, 1.0]), "metadata": {"k": 1}}).to_string(),
        String::new(),
        json!({"trajectories": [{"reward": "NaN", "prompt_ids": [1], "completion_ids": [2]}]}).to_string(),
        "{not json".to_string(),
        chat_group(&[0.5, 0.25]).to_string(),
        json!({"model": "ghost", "trajectories": chat_group(&[1.0])}).to_string(),
    ];
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("groups.jsonl");
    std::fs::write(&file, lines.join("\n")).unwrap();
    let out = trainq(&db, &["submit", file.to_str().unwrap(), "--model", "m1", "--quiet"]).await;
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(text(&out.stdout).contains("submitted 3 of 6 groups"), "{}", text(&out.stdout));
    assert!(stderr.contains("groups.jsonl:4: [TQ005] trajectory 0: field \"reward\" must be finite"), "{stderr}");
    assert!(stderr.contains("groups.jsonl:5: not valid JSON"), "{stderr}");
    assert!(stderr.contains("groups.jsonl:7: [TQ001] unknown model 'ghost'"), "{stderr}");
    assert!(stderr.contains("3 of 6 lines failed"), "{stderr}");
    assert_eq!(db.group_count().await, 3);

    let out = trainq(&db, &["status", "m1"]).await;
    let status = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let row = status.lines().find(|l| l.starts_with("m1")).unwrap_or_else(|| panic!("{status}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(&cols[..6], &["m1", "0", "3", "0", "0", "0"], "{status}");
    assert!(status.contains("no workers registered"), "{status}");
    let out = trainq(&db, &["steps", "m1"]).await;
    assert!(out.status.success() && text(&out.stdout).starts_with("  STEP"), "{}", text(&out.stderr));
}
