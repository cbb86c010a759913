//! The real `trainq worker` binary never exits on a row's content: groups it cannot decode
//! (stored before the database refused them) or whose token ids lie outside the model's
//! vocabulary are skipped `invalid` on their own, with the real error stored, and their
//! batch-mates train in the same step. And a worker connected as a `trainq_worker` member (the
//! least-privilege role) runs steps end to end, retention marks included.

mod common;
mod worker_support;

use std::path::Path;
use std::time::Duration;

use serde_json::json;
use trainq_queue::db::groups::{submit_groups, NewGroup};
use trainq_queue::db::steps::list_steps;
use trainq_queue::{GroupId, StepNumber};

use common::db::{TestDb, TestRole};
use worker_support::{build_model, groups, register, submit, tiny_config, WorkerProcess};

const RUN_LIMIT: Duration = Duration::from_secs(120);

/// A file:// store under `dir`.
fn file_store(dir: &Path) -> String {
    let root = dir.join("store");
    std::fs::create_dir_all(&root).unwrap();
    format!("file://{}", root.display())
}

/// Stores a group the way a database before migration 0009 accepted it (triggers off, as the
/// owner), sampled from checkpoint 0.
async fn insert_unchecked(db: &TestDb, trajectories: &str, metadata: &str) -> GroupId {
    let mut conn = db.pool.acquire().await.unwrap();
    sqlx::query("SET session_replication_role = replica").execute(&mut *conn).await.unwrap();
    sqlx::query_scalar(
        "INSERT INTO trainq.groups (model, trajectories, metadata, policy_version, reward_count, reward_mean, \
             reward_std, reward_distinct) VALUES ('m', $1::jsonb, $2::jsonb, 0, 2, 0.5, 0.5, 2) RETURNING id",
    )
    .bind(trajectories)
    .bind(metadata)
    .fetch_one(&mut *conn)
    .await
    .unwrap()
}

async fn skip_detail(db: &TestDb, id: GroupId) -> (String, Option<String>, Option<String>) {
    sqlx::query_as("SELECT state::text, skip_reason::text, skip_detail FROM trainq.groups WHERE id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_and_out_of_vocabulary_groups_are_skipped_invalid_and_their_batch_mates_train() {
    let db = TestDb::new().await;
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    // The model row knows no vocabulary (registered before 0009), so the insert cannot check ids.
    register(&db.pool, "m", &model_dir, tiny_config(5, 30)).await;
    let good = submit(&db.pool, "m", &[&[0.0, 1.0], &[1.0, 0.5]], Some(0)).await;
    let beyond = json!([{"prompt_ids": [1, 2], "completion_ids": [3, 999_999], "reward": 0.0},
                        {"prompt_ids": [1, 2], "completion_ids": [3, 4], "reward": 1.0}]);
    let group =
        NewGroup { model: "m".into(), trajectories: beyond, policy_version: Some(StepNumber(0)), metadata: json!({}) };
    let out_of_vocabulary = submit_groups(&db.pool, &[group]).await.unwrap()[0];
    let chat = |i: usize| {
        json!({"messages": [{"role": "user", "content": "count to three"},
                                              {"role": "assistant", "content": format!("one two {i}")}], "reward": i})
    };
    let two = json!([chat(0), chat(1)]).to_string();
    let huge_metadata = insert_unchecked(&db, &two, r#"{"score": 1e400}"#).await;
    let deep = format!("{}1{}", r#"{"a": "#.repeat(200), "}".repeat(200));
    let deep_metadata = insert_unchecked(&db, &two, &deep).await;

    let (url, store) = (db.url(None), file_store(work.path()));
    let mut worker = WorkerProcess::spawn(&url, "m", &store, None, &work.path().join("w"), &[], &["--max-steps", "1"]);
    assert!(worker.wait_exit(RUN_LIMIT), "the worker exited on a row's content:\n{}", worker.seen.join("\n"));

    let steps = list_steps(&db.pool, "m", 10).await.unwrap();
    assert_eq!(steps.len(), 1, "{}", worker.seen.join("\n"));
    assert_eq!((steps[0].groups_claimed, steps[0].groups_trained), (5, 2));
    assert_eq!(steps[0].groups_skipped, json!({"invalid": 3}));
    for id in &good {
        let row = groups(&db.pool, "m").await.into_iter().find(|g| g.id == *id).unwrap();
        assert_eq!((row.state.as_str(), row.step, row.attempts), ("trained", Some(1), 0), "batch-mate {id}");
    }
    for (id, error) in [
        (out_of_vocabulary, "token id 999999 at position"),
        (huge_metadata, "metadata: number out of range"),
        (deep_metadata, "metadata: recursion limit exceeded"),
    ] {
        let (state, reason, detail) = skip_detail(&db, id).await;
        assert_eq!((state.as_str(), reason.as_deref()), ("skipped", Some("invalid")), "{id}");
        assert!(detail.as_deref().is_some_and(|d| d.contains(error)), "{id}: {detail:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_connected_as_a_trainq_worker_member_trains_commits_and_applies_retention() {
    let db = TestDb::new().await;
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    register(&db.pool, "m", &model_dir, tiny_config(2, 30)).await;
    let role = TestRole::new(&db, "gpu", "trainq_worker").await;
    let (url, store) = (db.url(Some(&role.name)), file_store(work.path()));
    for step in 0..2 {
        submit(&db.pool, "m", &[&[0.0, 1.0], &[1.0, 0.5]], Some(step)).await;
        let args = ["--max-steps", "1", "--keep-last", "1"];
        let mut worker = WorkerProcess::spawn(&url, "m", &store, None, &work.path().join("w"), &[], &args);
        assert!(worker.wait_exit(RUN_LIMIT), "step {}:\n{}", step + 1, worker.seen.join("\n"));
    }
    let steps = list_steps(&db.pool, "m", 10).await.unwrap();
    assert_eq!(steps.iter().map(|s| s.step.get()).collect::<Vec<_>>(), vec![2, 1]);
    assert!(groups(&db.pool, "m").await.iter().all(|g| g.state == "trained"));
    // Retention removed step 1 from the store and marked its row (UPDATE of deleted_at only).
    let deleted: Vec<StepNumber> = trainq_queue::db::steps::deleted_checkpoint_steps(&db.pool, "m").await.unwrap();
    assert_eq!(deleted, vec![StepNumber(1)]);
}
