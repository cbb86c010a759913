//! Waiting for work: NOTIFY trainq_groups wakes a waiting claimer; polling works without it.

mod common;

use std::time::Duration;

use common::db::{chat_group, TestDb};
use tokio::time::Instant;
use trainq_queue::db::{self, ClaimParams};
use trainq_queue::queue::GroupWaiter;

fn params() -> ClaimParams {
    ClaimParams { model: "m1".into(), worker_id: "w".into(), limit: 8, lease_seconds: 60.0, now: None, window: None }
}

async fn submit(pool: &sqlx::PgPool, model: &str) {
    sqlx::query("INSERT INTO trainq.groups (model, trajectories) VALUES ($1, $2)")
        .bind(model)
        .bind(chat_group(&[0.0, 1.0]))
        .execute(pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_notification_wakes_a_waiting_claimer_long_before_its_poll_interval() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    db.create_model("other").await;
    // Poll only once an hour: only the notification can wake the waiter within the test.
    let mut waiter = GroupWaiter::listen(&db.pool, Duration::from_secs(3600)).await.unwrap();
    let pool = db.pool.clone();
    let started = Instant::now();
    let waiting = tokio::spawn(async move {
        let found = waiter.wait("m1", Duration::from_secs(60)).await.unwrap();
        let claim = db::claim_groups(&pool, &params()).await.unwrap();
        (found, claim.groups.len())
    });
    submit(&db.pool, "other").await; // another model's notification must not end the wait
    submit(&db.pool, "m1").await;
    let (found, claimed) = tokio::time::timeout(Duration::from_secs(30), waiting).await.unwrap().unwrap();
    assert!(found);
    assert_eq!(claimed, 1);
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[tokio::test]
async fn polling_finds_groups_when_no_notification_is_sent() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    sqlx::query("ALTER TABLE trainq.groups DISABLE TRIGGER groups_notify").execute(&db.pool).await.unwrap();
    let mut listening = GroupWaiter::listen(&db.pool, Duration::from_millis(50)).await.unwrap();
    let mut polling = GroupWaiter::poll_only(&db.pool, Duration::from_millis(50));
    assert!(!polling.wait("m1", Duration::from_millis(120)).await.unwrap(), "nothing pending yet");
    let pool = db.pool.clone();
    let waiting = tokio::spawn(async move {
        let a = listening.wait("m1", Duration::from_secs(60)).await.unwrap();
        let b = polling.wait("m1", Duration::from_secs(60)).await.unwrap();
        (a, b)
    });
    submit(&pool, "m1").await;
    let (a, b) = tokio::time::timeout(Duration::from_secs(30), waiting).await.unwrap().unwrap();
    assert!(a && b);
    assert_eq!(db::claim_groups(&db.pool, &params()).await.unwrap().groups.len(), 1);
}

#[tokio::test]
async fn wait_for_groups_returns_at_once_when_groups_are_already_pending() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    submit(&db.pool, "m1").await;
    let started = Instant::now();
    assert!(trainq_queue::queue::wait_for_groups(&db.pool, "m1", Duration::from_secs(60)).await.unwrap());
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[tokio::test]
async fn a_concurrent_insert_of_the_same_model_leaves_the_notification_to_the_open_notifier() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    db.create_model("sentinel").await;
    let mut listener = sqlx::postgres::PgListener::connect_with(&db.pool).await.unwrap();
    listener.listen("trainq_groups").await.unwrap();
    // A inserts and holds the model's notify slot until it commits.
    let mut a = db.pool.begin().await.unwrap();
    sqlx::query("INSERT INTO trainq.groups (model, trajectories) VALUES ('m1', $1)")
        .bind(chat_group(&[0.0, 1.0]))
        .execute(&mut *a)
        .await
        .unwrap();
    submit(&db.pool, "m1").await; // B commits meanwhile and skips its NOTIFY
    a.commit().await.unwrap(); // A's NOTIFY goes out
    submit(&db.pool, "sentinel").await; // delivered after everything above (commit order)
    let mut m1_notes = 0;
    loop {
        let note = tokio::time::timeout(Duration::from_secs(30), listener.recv()).await.unwrap().unwrap();
        match note.payload() {
            "sentinel" => break,
            "m1" => m1_notes += 1,
            other => panic!("unexpected payload {other}"),
        }
    }
    assert_eq!(m1_notes, 1, "two inserts of m1, one notification");
    assert_eq!(db::count_pending(&db.pool, "m1").await.unwrap(), 2);
}
