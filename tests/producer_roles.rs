//! The roles over real connections: a `trainq_producer` member may insert groups and call the
//! producer functions, and nothing else; it never sees another producer's groups and cannot
//! take (or stall) the commit lock; a `trainq_worker` member runs the queue and commits steps,
//! and cannot rewrite models, history or producers' groups.

mod common;

use std::time::{Duration, Instant};

use common::db::{chat_group, insert_groups, TestDb, TestRole};
use serde_json::json;
use sqlx::PgPool;
use trainq_queue::db::commit_lock::lock_commits;
use trainq_queue::db::skipped_passes::{record_skipped_pass, SkippedPass};
use trainq_queue::db::{self, CheckpointRecord, ClaimParams, StepRecord};
use trainq_queue::{GroupId, StepNumber};

async fn insert_returning_id(pool: &PgPool) -> GroupId {
    sqlx::query_scalar("INSERT INTO trainq.groups (model, trajectories, policy_version, metadata) VALUES ('m1', $1, 0, '{\"a\": 1}') RETURNING id")
        .bind(chat_group(&[0.0, 1.0]))
        .fetch_one(pool)
        .await
        .unwrap()
}

fn assert_denied(result: Result<sqlx::postgres::PgQueryResult, sqlx::Error>, what: &str) {
    let err = result.expect_err(what);
    let db_err = err.as_database_error().unwrap_or_else(|| panic!("{what}: {err}"));
    assert_eq!(db_err.code().as_deref(), Some("42501"), "{what}: {}", db_err.message());
    assert!(db_err.message().contains("permission denied"), "{what}: {}", db_err.message());
}

#[tokio::test]
async fn a_producer_inserts_and_submits_and_sees_only_its_own_groups() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    let (alice, bob) =
        (TestRole::new(&db, "alice", "trainq_producer").await, TestRole::new(&db, "bob", "trainq_producer").await);
    let (as_alice, as_bob) = (db.connect_as(Some(&alice.name), 2).await, db.connect_as(Some(&bob.name), 2).await);
    let a1 = insert_returning_id(&as_alice).await;
    let a2: GroupId = sqlx::query_scalar("SELECT trainq.submit_group('m1', $1, policy_version => 0)")
        .bind(chat_group(&[1.0, 0.5]))
        .fetch_one(&as_alice)
        .await
        .unwrap();
    let b1 = insert_returning_id(&as_bob).await;
    let mine: Vec<GroupId> =
        sqlx::query_scalar("SELECT id FROM trainq.groups ORDER BY id").fetch_all(&as_alice).await.unwrap();
    assert_eq!(mine, vec![a1, a2]);
    let owners: Vec<String> = sqlx::query_scalar("SELECT submitted_by::text FROM trainq.groups ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(owners, vec![alice.name.clone(), alice.name.clone(), bob.name.clone()]);
    // Bob's group is invisible to Alice, through the table and through group_status.
    let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM trainq.groups WHERE id = $1")
        .bind(b1)
        .fetch_one(&as_alice)
        .await
        .unwrap();
    assert_eq!(seen, 0);
    assert_eq!(db::group_status(&as_alice, b1).await.unwrap(), None);
    assert_eq!(db::group_status(&as_bob, b1).await.unwrap().unwrap().state, "pending");
    assert_eq!(db::group_status(&as_alice, a2).await.unwrap().unwrap().reward_std, Some(0.25));
    // latest_checkpoint is open to producers (no row before the first step).
    let latest: Option<i64> =
        sqlx::query_scalar("SELECT step FROM trainq.latest_checkpoint('m1')").fetch_optional(&as_alice).await.unwrap();
    assert_eq!(latest, None);
}

#[tokio::test]
async fn a_producer_cannot_update_delete_read_payloads_or_touch_other_tables() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    let alice = TestRole::new(&db, "alice", "trainq_producer").await;
    let pool = db.connect_as(Some(&alice.name), 2).await;
    let id = insert_returning_id(&pool).await;
    let denied = [
        ("update own group", format!("UPDATE trainq.groups SET state = 'trained' WHERE id = '{id}'")),
        ("delete own group", format!("DELETE FROM trainq.groups WHERE id = '{id}'")),
        ("read trajectories", "SELECT trajectories FROM trainq.groups".to_string()),
        ("read claim tokens", "SELECT claim_token FROM trainq.groups".to_string()),
        ("insert a state", format!("INSERT INTO trainq.groups (model, trajectories, state) VALUES ('m1', '{}', 'trained')", chat_group(&[1.0]))),
        ("forge submitted_by", format!("INSERT INTO trainq.groups (model, trajectories, submitted_by) VALUES ('m1', '{}', 'bob')", chat_group(&[1.0]))),
        ("read models", "SELECT * FROM trainq.models".to_string()),
        ("advance a model", "UPDATE trainq.models SET current_step = 9".to_string()),
        ("register a model", "INSERT INTO trainq.models (name, base) VALUES ('x', '/b')".to_string()),
        ("write steps", "INSERT INTO trainq.steps (model, step, worker_id, async_weight_syncing, started_at, finished_at, groups_claimed, groups_trained, trajectories, tokens) VALUES ('m1', 1, 'w', false, now(), now(), 0, 0, 0, 0)".to_string()),
        ("read checkpoints", "SELECT * FROM trainq.checkpoints".to_string()),
        ("write workers", "INSERT INTO trainq.workers (id, host) VALUES ('w', 'h')".to_string()),
        ("read the trajectories view", "SELECT * FROM trainq.trajectories".to_string()),
        ("call the validation helpers", "SELECT trainq.check_trajectory(0, '{}')".to_string()),
    ];
    for (what, sql) in &denied {
        assert_denied(sqlx::query(sql).execute(&pool).await, what);
    }
    let claim = db::claim_groups(
        &pool,
        &ClaimParams {
            model: "m1".into(),
            worker_id: "p".into(),
            limit: 1,
            lease_seconds: 9.0,
            now: None,
            window: None,
        },
    )
    .await;
    assert!(claim.is_err(), "a producer cannot claim");
    let state: String = sqlx::query_scalar("SELECT state::text FROM trainq.groups").fetch_one(&db.pool).await.unwrap();
    assert_eq!(state, "pending");
    assert_eq!(db.group_count().await, 1);
}

#[tokio::test]
async fn a_worker_role_runs_the_queue() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    insert_groups(&db.pool, "m1", 3).await;
    let worker = TestRole::new(&db, "worker", "trainq_worker").await;
    let pool = db.connect_as(Some(&worker.name), 2).await;
    let claim = db::claim_groups(
        &pool,
        &ClaimParams {
            model: "m1".into(),
            worker_id: "w".into(),
            limit: 2,
            lease_seconds: 60.0,
            now: None,
            window: None,
        },
    )
    .await
    .unwrap();
    assert_eq!(claim.groups.len(), 2);
    db::extend_lease(&pool, claim.token, 60.0).await.unwrap();
    let ids: Vec<GroupId> = claim.groups.iter().map(|g| g.id).collect();
    db::fail_groups(&pool, claim.token, &ids, "test").await.unwrap();
    db::register_worker(
        &pool,
        &db::WorkerInfo {
            id: "w".into(),
            host: "h".into(),
            model: Some("m1".into()),
            devices: serde_json::json!(["cpu"]),
        },
    )
    .await
    .unwrap();
    db::heartbeat_worker(&pool, "w").await.unwrap();
    assert_eq!(db::rescue_expired(&pool, None).await.unwrap().returned, 0);
    let counts = db::queue_counts(&pool, None).await.unwrap();
    assert_eq!((counts[0].pending, counts[0].failed), (1, 2));
    assert_eq!(db::list_workers(&pool, Some("m1")).await.unwrap().len(), 1);
}

/// Runs `sql` in a transaction of its own (LOCK TABLE needs one) and asserts it is denied.
async fn assert_denied_in_transaction(pool: &PgPool, sql: &str) {
    let mut tx = pool.begin().await.unwrap();
    assert_denied(sqlx::query(sql).execute(&mut *tx).await, sql);
}

#[tokio::test]
async fn a_producer_cannot_take_the_commit_lock_nor_stall_commits_with_the_old_advisory_key() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    let (alice, worker) =
        (TestRole::new(&db, "alice", "trainq_producer").await, TestRole::new(&db, "worker", "trainq_worker").await);
    let (as_alice, as_worker) = (db.connect_as(Some(&alice.name), 2).await, db.connect_as(Some(&worker.name), 4).await);
    lock_commits(&as_worker, "m1").await.unwrap().release().await;
    for sql in [
        "SELECT * FROM trainq.commit_locks FOR UPDATE",
        "SELECT * FROM trainq.commit_locks FOR KEY SHARE",
        "LOCK TABLE trainq.commit_locks IN ACCESS SHARE MODE",
        "DELETE FROM trainq.commit_locks",
        "INSERT INTO trainq.commit_locks (model) VALUES ('m1')",
    ] {
        assert_denied_in_transaction(&as_alice, sql).await;
    }
    // The session advisory lock that guarded commits before migration 0010, held by a producer.
    let mut squatter = as_alice.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(hashtextextended('trainq.commit:' || 'm1', 0))")
        .execute(&mut *squatter)
        .await
        .unwrap();
    let held = tokio::time::timeout(Duration::from_secs(10), lock_commits(&as_worker, "m1"))
        .await
        .expect("a producer's lock does not stall the commit lock")
        .unwrap();
    // The lock still keeps a second worker out until the first releases it.
    let second = tokio::spawn({
        let pool = as_worker.clone();
        async move { lock_commits(&pool, "m1").await.map(|_| ()) }
    });
    let start = Instant::now();
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if waiting == 1 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "the second worker never waited for the lock");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!second.is_finished());
    held.release().await;
    tokio::time::timeout(Duration::from_secs(10), second).await.expect("taken once released").unwrap().unwrap();
}

fn step_record(step: i64) -> StepRecord {
    serde_json::from_value(json!({
        "model": "m1", "step": step, "worker_id": "w", "async_weight_syncing": false,
        "started_at": "2025-01-01T00:00:00Z", "finished_at": "2025-01-01T00:00:01Z",
        "groups_claimed": 1, "groups_wanted": 1, "groups_trained": 1, "groups_skipped": {}, "trajectories": 2,
        "tokens": 10, "loss": 0.5, "loss_parts": {}, "grad_norm": 1.0, "learning_rate": 1e-5, "reward_mean": 0.5,
        "reward_mean_claimed": 0.5, "reward_mean_skipped": null, "logprob_coverage": 1.0,
        "importance_ratio_mean": 1.0, "reward_std_mean": 0.5, "policy_lag_min": 0, "policy_lag_max": 0,
        "timings": {}, "devices": ["cpu"], "checkpoint_uri": format!("file:///ckpt/m1/{step:06}/"),
        "checkpoint_sha256": "ab".repeat(32)
    }))
    .unwrap()
}

#[tokio::test]
async fn a_worker_role_commits_steps_and_marks_checkpoints_but_cannot_rewrite_models_history_or_groups() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    insert_groups(&db.pool, "m1", 2).await;
    let worker = TestRole::new(&db, "worker", "trainq_worker").await;
    let pool = db.connect_as(Some(&worker.name), 4).await;
    // What the worker does: claim, take the commit lock, commit a step with its checkpoint,
    // record a skipped pass, mark a deleted checkpoint, read the latest.
    let params = ClaimParams {
        model: "m1".into(),
        worker_id: "w".into(),
        limit: 1,
        lease_seconds: 60.0,
        now: None,
        window: None,
    };
    let claim = db::claim_groups(&pool, &params).await.unwrap();
    let lock = lock_commits(&pool, "m1").await.unwrap();
    let step = step_record(1);
    let checkpoint = CheckpointRecord {
        model: "m1".into(),
        step: StepNumber(1),
        uri: "file:///ckpt/m1/000001/".into(),
        format: "peft_lora".into(),
        bytes: 10,
        sha256: "ab".repeat(32),
        manifest: json!({"files": []}),
    };
    let ids: Vec<GroupId> = claim.groups.iter().map(|g| g.id).collect();
    db::commit_step(&pool, &step, Some(&checkpoint), claim.token, &ids, &[]).await.unwrap();
    lock.release().await;
    let rest = db::claim_groups(&pool, &params).await.unwrap();
    let skip = trainq_queue::rl::SkippedGroup {
        id: rest.groups[0].id,
        reason: trainq_queue::rl::SkipReason::ZeroVariance,
        std: Some(0.0),
        detail: None,
    };
    let pass = SkippedPass {
        model: "m1".into(),
        current_step: StepNumber(1),
        worker_id: "w".into(),
        started_at: chrono::Utc::now(),
        groups_claimed: 1,
        groups_skipped: json!({"zero_variance": 1}),
        reward_mean_claimed: Some(0.5),
        reward_std_mean: Some(0.0),
    };
    record_skipped_pass(&pool, rest.token, &pass, &[skip]).await.unwrap();
    assert_eq!(db::latest_checkpoint(&pool, "m1").await.unwrap().map(|c| c.step), Some(StepNumber(1)));
    assert_eq!(db::mark_checkpoints_deleted(&pool, "m1", &[StepNumber(1)]).await.unwrap(), 1);

    // What it may not.
    let group = chat_group(&[0.0, 1.0]);
    let denied = [
        ("point a model at other weights", "UPDATE trainq.models SET base = '/evil'".to_string()),
        ("rewrite a model's config", "UPDATE trainq.models SET config = '{}'".to_string()),
        ("change a model's limits", "UPDATE trainq.models SET max_group_bytes = 1, vocab_size = 1".to_string()),
        ("register a model", "INSERT INTO trainq.models (name, base) VALUES ('x', '/b')".to_string()),
        ("delete a model", "DELETE FROM trainq.models".to_string()),
        ("rewrite a step", "UPDATE trainq.steps SET loss = 0, checkpoint_uri = 's3://evil/'".to_string()),
        ("delete a step", "DELETE FROM trainq.steps".to_string()),
        ("repoint a checkpoint", "UPDATE trainq.checkpoints SET uri = 's3://evil/'".to_string()),
        ("rewrite a checkpoint's hash", format!("UPDATE trainq.checkpoints SET sha256 = '{}'", "cd".repeat(32))),
        ("delete a checkpoint", "DELETE FROM trainq.checkpoints".to_string()),
        (
            "forge submitted_by",
            format!("INSERT INTO trainq.groups (model, trajectories, submitted_by) VALUES ('m1', '{group}', 'alice')"),
        ),
        ("submit a group", format!("INSERT INTO trainq.groups (model, trajectories) VALUES ('m1', '{group}')")),
        ("submit through the function", format!("SELECT trainq.submit_group('m1', '{group}')")),
        ("rewrite a payload", "UPDATE trainq.groups SET trajectories = '[]'".to_string()),
        ("reattribute a group", "UPDATE trainq.groups SET submitted_by = 'alice'".to_string()),
        ("rewrite statistics", "UPDATE trainq.groups SET reward_mean = 9, policy_version = 0".to_string()),
        ("delete groups", "DELETE FROM trainq.groups".to_string()),
        ("truncate groups", "TRUNCATE trainq.groups".to_string()),
        ("delete workers", "DELETE FROM trainq.workers".to_string()),
        ("rewrite a skipped pass", "UPDATE trainq.skipped_passes SET groups_claimed = 9".to_string()),
    ];
    for (what, sql) in &denied {
        assert_denied(sqlx::query(sql).execute(&pool).await, what);
    }
    let base: String = sqlx::query_scalar("SELECT base FROM trainq.models").fetch_one(&db.pool).await.unwrap();
    assert_eq!(base, "/models/base");
    assert_eq!(db.group_count().await, 2);
}
