//! The queue under hostile rows and lost connections, against real PostgreSQL: a claim returns a
//! group whose stored JSON does not decode marked unusable, with its batch-mates whole; a lost
//! LISTEN connection is re-established and notifications wake the waiter again; a group whose
//! claim ended without a result backs off, so fresh groups are claimed first.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use chrono::{TimeDelta, Utc};
use common::db::{insert_groups, TestDb};
use common::tcp_proxy::TcpProxy;
use trainq_queue::config::UnknownPolicyVersion;
use trainq_queue::db::{self, ClaimParams, PolicyWindow};
use trainq_queue::queue::GroupWaiter;
use trainq_queue::rl::{filter_groups, FilterParams, SkipReason};
use trainq_queue::{GroupId, StepNumber};

const DEADLINE: Duration = Duration::from_secs(30);

fn params(limit: i64) -> ClaimParams {
    ClaimParams { model: "m1".into(), worker_id: "w".into(), limit, lease_seconds: 60.0, now: None, window: None }
}

/// Stores a group the way a database before migration 0009 accepted it: triggers off (as the
/// owner), statistics given.
async fn insert_unchecked(db: &TestDb, trajectories: &str, metadata: &str) -> GroupId {
    let mut conn = db.pool.acquire().await.unwrap();
    sqlx::query("SET session_replication_role = replica").execute(&mut *conn).await.unwrap();
    let id = sqlx::query_scalar(
        "INSERT INTO trainq.groups (model, trajectories, metadata, reward_count, reward_mean, reward_std, reward_distinct) \
         VALUES ('m1', $1::jsonb, $2::jsonb, 2, 0.5, 0.5, 2) RETURNING id",
    )
    .bind(trajectories)
    .bind(metadata)
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    sqlx::query("RESET session_replication_role").execute(&mut *conn).await.unwrap();
    id
}

#[tokio::test]
async fn a_claim_marks_an_undecodable_group_unusable_and_returns_its_batch_mates_whole() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    let two = r#"[{"prompt_ids": [1], "completion_ids": [2], "reward": 0}, {"prompt_ids": [1], "completion_ids": [2], "reward": 1}]"#;
    insert_groups(&db.pool, "m1", 1).await;
    let huge = insert_unchecked(&db, two, r#"{"x": 1e400}"#).await;
    let deep = format!("{}1{}", r#"{"a": "#.repeat(200), "}".repeat(200));
    let nested = insert_unchecked(&db, two, &deep).await;
    let in_trajectory = insert_unchecked(
        &db,
        r#"[{"prompt_ids": [1], "completion_ids": [2], "reward": 1, "metrics": {"m": -1e999}}]"#,
        "{}",
    )
    .await;
    insert_groups(&db.pool, "m1", 1).await;

    let claim = db::claim_groups(&db.pool, &params(10)).await.expect("a claim never fails on a row's content");
    assert_eq!(claim.groups.len(), 5);
    let unusable: HashMap<GroupId, String> =
        claim.groups.iter().filter_map(|g| g.unusable.clone().map(|why| (g.id, why))).collect();
    assert_eq!(unusable.len(), 3, "{unusable:?}");
    assert!(unusable[&huge].contains("metadata: number out of range"), "{}", unusable[&huge]);
    assert!(unusable[&nested].contains("metadata: recursion limit exceeded"), "{}", unusable[&nested]);
    assert!(unusable[&in_trajectory].contains("trajectories: number out of range"), "{}", unusable[&in_trajectory]);
    for good in claim.groups.iter().filter(|g| g.unusable.is_none()) {
        assert_eq!(good.rewards(), vec![0.0, 1.0]);
    }
    // The filter skips exactly those `invalid`, with the decode error as the detail.
    let rewards: Vec<_> = claim.groups.iter().map(|g| g.to_group_rewards()).collect();
    let report = filter_groups(
        &rewards,
        &FilterParams {
            zero_variance_tolerance: 1e-6,
            current_step: StepNumber(0),
            accepted_staleness: 0,
            accept_unknown_policy_version: true,
        },
    );
    assert_eq!(report.kept.len(), 2);
    assert_eq!(report.count(SkipReason::Invalid), 3);
    assert!(report
        .skipped
        .iter()
        .all(|s| s.detail.as_deref().is_some_and(|d| d.starts_with("stored JSON does not decode"))));
}

/// The backend pids of LISTEN connections on this test's database.
async fn listener_pids(db: &TestDb) -> Vec<i32> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query ILIKE 'LISTEN%' ORDER BY pid",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

async fn wait_for_listener_other_than(db: &TestDb, old: Option<i32>) -> i32 {
    let start = Instant::now();
    loop {
        if let Some(pid) = listener_pids(db).await.into_iter().find(|pid| Some(*pid) != old) {
            return pid;
        }
        assert!(start.elapsed() < DEADLINE, "no new LISTEN connection within {DEADLINE:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls `what` until it holds; panics after [`DEADLINE`].
async fn wait_until<F: std::future::Future<Output = bool>>(what: &str, mut condition: impl FnMut() -> F) {
    let start = Instant::now();
    while !condition().await {
        assert!(start.elapsed() < DEADLINE, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_lost_listen_connection_is_re_established_and_notifications_wake_the_waiter_again() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    // The waiter reaches the database through a proxy that the test cuts, like a restart.
    let direct = url::Url::parse(&db.url(None)).unwrap();
    let proxy = TcpProxy::start(format!("{}:{}", direct.host_str().unwrap(), direct.port().unwrap_or(5432))).await;
    let mut via_proxy = direct.clone();
    via_proxy.set_host(Some("127.0.0.1")).unwrap();
    via_proxy.set_port(Some(proxy.addr.port())).unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(via_proxy.as_str()).await.unwrap();
    // A poll interval far beyond the test: only a notification can end the wait in time.
    let mut waiter = GroupWaiter::listen(&pool, Duration::from_secs(600)).await.unwrap();
    let first = wait_for_listener_other_than(&db, None).await;
    let waiting = tokio::spawn(async move {
        let found = waiter.wait("m1", Duration::from_secs(300)).await.unwrap();
        (found, waiter.is_listening())
    });
    // The waiter has looked at the table and is waiting on LISTEN.
    let checked = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                   AND state = 'idle' AND query LIKE '%state = ''pending'' AND (retry_after%'";
    wait_until("the waiter checked the table", || async {
        sqlx::query_scalar::<_, i64>(checked).fetch_one(&db.pool).await.unwrap() > 0
    })
    .await;
    proxy.cut();
    wait_until("the LISTEN backend is gone", || async { listener_pids(&db).await.is_empty() }).await;
    // The outage lasts a moment, so that the first attempts to reconnect fail.
    tokio::time::sleep(Duration::from_secs(1)).await;
    proxy.restore();
    let second = wait_for_listener_other_than(&db, Some(first)).await;
    assert_ne!(second, first);
    insert_groups(&db.pool, "m1", 1).await;
    let (found, listening) = tokio::time::timeout(DEADLINE, waiting).await.expect("woken by NOTIFY").unwrap();
    assert!(found && listening, "found {found}, listening {listening}");
}

#[tokio::test]
async fn a_group_whose_claim_ended_without_a_result_backs_off_so_fresh_groups_are_claimed_first() {
    let db = TestDb::new().await;
    db.create_model("m1").await; // retry_backoff_seconds = 10 by default
    insert_groups(&db.pool, "m1", 2).await;
    let died_on = db::claim_groups(&db.pool, &params(2)).await.unwrap();
    let died_ids: Vec<GroupId> = died_on.groups.iter().map(|g| g.id).collect();
    // The worker crashed: its lease runs out and the rescuer returns the batch.
    let rescued_at = Utc::now() + TimeDelta::seconds(61);
    assert_eq!(db::rescue_expired(&db.pool, Some(rescued_at)).await.unwrap().returned, 2);
    insert_groups(&db.pool, "m1", 2).await;
    // The restarted worker claims the fresh groups, not the batch it died on.
    let at = |seconds: i64| ClaimParams { now: Some(rescued_at + TimeDelta::seconds(seconds)), ..params(2) };
    let next = db::claim_groups(&db.pool, &at(1)).await.unwrap();
    assert_eq!(next.groups.len(), 2);
    assert!(next.groups.iter().all(|g| !died_ids.contains(&g.id) && g.attempts == 0));
    assert!(db::claim_groups(&db.pool, &at(9)).await.unwrap().groups.is_empty(), "10 s after a first attempt");
    let retried = db::claim_groups(&db.pool, &at(11)).await.unwrap();
    assert_eq!(retried.groups.iter().map(|g| g.id).collect::<Vec<_>>(), died_ids);
    // A second failed attempt doubles the wait.
    db::release_groups(&db.pool, retried.token, &died_ids, "worker crashed").await.unwrap();
    let retry_after: Vec<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM retry_after - now())::float8 FROM trainq.groups WHERE id = ANY($1)",
    )
    .bind(&died_ids)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(retry_after.iter().all(|s| (19.0..=20.5).contains(s)), "{retry_after:?}");
    // Waiting for a batch does not count groups that are backing off.
    let window = PolicyWindow {
        current_step: StepNumber(0),
        accepted_staleness: 0,
        unknown_policy_version: UnknownPolicyVersion::Accept,
        too_old_limit: 0,
    };
    assert_eq!(db::count_claimable(&db.pool, "m1", &window).await.unwrap().eligible, 0);
    assert!(!db::has_pending(&db.pool, "m1").await.unwrap());
    assert_eq!(db::count_pending(&db.pool, "m1").await.unwrap(), 2, "still pending, only not yet");
}

#[tokio::test]
async fn a_model_without_retry_backoff_retries_at_once() {
    let db = TestDb::new().await;
    let mut model = db::NewModel::new("m1", "/base");
    model.config.queue.retry_backoff_seconds = 0.0;
    db::create_model(&db.pool, &model).await.unwrap();
    insert_groups(&db.pool, "m1", 1).await;
    let claim = db::claim_groups(&db.pool, &params(1)).await.unwrap();
    db::release_groups(&db.pool, claim.token, &[claim.groups[0].id], "boom").await.unwrap();
    assert_eq!(db::claim_groups(&db.pool, &params(1)).await.unwrap().groups.len(), 1);
}
