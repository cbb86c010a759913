//! The roles over real connections: a `trainq_producer` member may insert groups and call the
//! producer functions, and nothing else; it never sees another producer's groups; a
//! `trainq_worker` member runs the queue.

mod common;

use common::db::{chat_group, insert_groups, TestDb, TestRole};
use sqlx::PgPool;
use trainq_queue::db::{self, ClaimParams};
use trainq_queue::GroupId;

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
