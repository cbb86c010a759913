//! Claiming against the real PostgreSQL: concurrency, leases, rescue, fencing, max_attempts,
//! and the fenced step commit.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use chrono::{SubsecRound, TimeDelta, Utc};
use common::db::{chat_group, insert_groups, TestDb};
use serde_json::json;
use tokio::sync::Barrier;
use trainq_queue::db::{self, CheckpointRecord, ClaimParams, StepRecord};
use trainq_queue::rl::{SkipReason, SkippedGroup};
use trainq_queue::Error;
use trainq_queue::GroupId;
use trainq_queue::StepNumber;

fn params(model: &str, worker: &str, limit: i64) -> ClaimParams {
    ClaimParams { model: model.into(), worker_id: worker.into(), limit, lease_seconds: 60.0, now: None, window: None }
}

async fn state_of(db: &TestDb, id: GroupId) -> (String, i32, Option<String>) {
    sqlx::query_as("SELECT state::text, attempts, error FROM trainq.groups WHERE id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_concurrent_claimers_claim_each_of_16000_groups_exactly_once() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    insert_groups(&db.pool, "m1", 16_000).await;
    let barrier = Arc::new(Barrier::new(8));
    let mut tasks = Vec::new();
    for w in 0..8 {
        let (pool, barrier) = (db.pool.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut mine = Vec::new();
            loop {
                let claim = db::claim_groups(&pool, &params("m1", &format!("w{w}"), 32)).await.unwrap();
                if claim.groups.is_empty() {
                    return mine;
                }
                mine.extend(claim.groups.iter().map(|g| g.id));
            }
        }));
    }
    let mut seen = HashSet::new();
    let mut total = 0;
    for task in tasks {
        let ids = task.await.unwrap();
        total += ids.len();
        seen.extend(ids);
    }
    assert_eq!(total, 16_000, "every group claimed once in total");
    assert_eq!(seen.len(), 16_000, "no group claimed twice");
    let claimed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM trainq.groups WHERE state = 'claimed' AND claim_token IS NOT NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(claimed, 16_000);
}

#[tokio::test]
async fn a_claim_returns_groups_oldest_first_with_their_statistics() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    let first = db::submit_group(
        &db.pool,
        &db::NewGroup {
            model: "m1".into(),
            trajectories: chat_group(&[1.0, 0.0, 0.0, 1.0]),
            policy_version: Some(StepNumber(0)),
            metadata: json!({"scenario": "a"}),
        },
    )
    .await
    .unwrap();
    insert_groups(&db.pool, "m1", 2).await;
    let claim = db::claim_groups(&db.pool, &params("m1", "w", 2)).await.unwrap();
    assert_eq!(claim.groups.len(), 2);
    let g = &claim.groups[0];
    assert_eq!(g.id, first);
    assert_eq!((g.reward_count, g.reward_mean, g.reward_std, g.attempts), (4, 0.5, 0.5, 0));
    assert_eq!(g.rewards(), vec![1.0, 0.0, 0.0, 1.0]);
    assert_eq!(g.policy_version, Some(StepNumber(0)));
    assert_eq!(g.metadata, json!({"scenario": "a"}));
    assert_eq!(db::count_pending(&db.pool, "m1").await.unwrap(), 1);
}

#[tokio::test]
async fn an_expired_lease_is_rescued_to_pending_and_claimed_again() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    insert_groups(&db.pool, "m1", 3).await;
    let first = db::claim_groups(&db.pool, &params("m1", "dead-worker", 10)).await.unwrap();
    assert_eq!(first.groups.len(), 3);
    assert!(db::claim_groups(&db.pool, &params("m1", "w2", 10)).await.unwrap().groups.is_empty());
    // Not expired yet: the rescuer leaves the claim alone.
    assert_eq!(db::rescue_expired(&db.pool, None).await.unwrap().returned, 0);
    let later = Utc::now() + TimeDelta::seconds(61);
    let report = db::rescue_expired(&db.pool, Some(later)).await.unwrap();
    assert_eq!((report.returned, report.failed), (3, 0));
    // Back off first (queue.retry_backoff_seconds, default 10 s for a first attempt).
    let at = |seconds| ClaimParams { now: Some(later + TimeDelta::seconds(seconds)), ..params("m1", "w2", 10) };
    assert!(db::claim_groups(&db.pool, &at(9)).await.unwrap().groups.is_empty());
    let again = db::claim_groups(&db.pool, &at(11)).await.unwrap();
    assert_eq!(again.groups.len(), 3);
    assert!(again.groups.iter().all(|g| g.attempts == 1));
    let (state, attempts, error) = state_of(&db, again.groups[0].id).await;
    assert_eq!((state.as_str(), attempts), ("claimed", 1));
    assert!(error.unwrap().contains("lease expired (attempt 1 of 3, worker dead-worker)"));
}

#[tokio::test]
async fn a_stale_token_can_record_nothing() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    insert_groups(&db.pool, "m1", 2).await;
    let old = db::claim_groups(&db.pool, &params("m1", "slow", 10)).await.unwrap();
    let later = Utc::now() + TimeDelta::seconds(120);
    db::rescue_expired(&db.pool, Some(later)).await.unwrap();
    let after_backoff = Some(later + TimeDelta::seconds(60));
    let new =
        db::claim_groups(&db.pool, &ClaimParams { now: after_backoff, ..params("m1", "fast", 10) }).await.unwrap();
    let ids: Vec<GroupId> = old.groups.iter().map(|g| g.id).collect();
    let skip = vec![SkippedGroup { id: ids[0], reason: SkipReason::ZeroVariance, std: Some(0.0), detail: None }];
    assert!(matches!(db::skip_groups(&db.pool, old.token, &skip).await, Err(Error::LostClaim { .. })));
    assert!(matches!(db::fail_groups(&db.pool, old.token, &ids, "boom").await, Err(Error::LostClaim { .. })));
    assert!(matches!(db::extend_lease(&db.pool, old.token, 60.0).await, Err(Error::LostClaim { .. })));
    let step = step_record("m1", 1, "slow", ids.len());
    let err = db::commit_step(&db.pool, &step, None, old.token, &ids, &[]).await.unwrap_err();
    assert!(matches!(&err, Error::LostClaim { model, groups: 2 } if model == "m1"), "{err}");
    // Nothing was written by the stale worker; the new claim still holds both groups.
    let steps: i64 = sqlx::query_scalar("SELECT count(*) FROM trainq.steps").fetch_one(&db.pool).await.unwrap();
    assert_eq!(steps, 0);
    assert_eq!(db::get_model(&db.pool, "m1").await.unwrap().current_step, StepNumber(0));
    for id in &ids {
        assert_eq!(state_of(&db, *id).await.0, "claimed");
    }
    assert_eq!(db::extend_lease(&db.pool, new.token, 60.0).await.unwrap(), 2);
}

#[tokio::test]
async fn a_fenced_write_touching_one_lost_group_writes_none() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    insert_groups(&db.pool, "m1", 2).await;
    let claim = db::claim_groups(&db.pool, &params("m1", "w", 10)).await.unwrap();
    let ids: Vec<GroupId> = claim.groups.iter().map(|g| g.id).collect();
    db::fail_groups(&db.pool, claim.token, &ids[..1], "bad group").await.unwrap();
    // ids[0] is finished now, so a skip of both must refuse and leave ids[1] claimed.
    let skips: Vec<SkippedGroup> =
        ids.iter().map(|id| SkippedGroup { id: *id, reason: SkipReason::Stale, std: None, detail: None }).collect();
    assert!(matches!(db::skip_groups(&db.pool, claim.token, &skips).await, Err(Error::LostClaim { .. })));
    assert_eq!(state_of(&db, ids[1]).await.0, "claimed");
    assert_eq!(state_of(&db, ids[0]).await.0, "failed");
}

#[tokio::test]
async fn a_group_fails_after_max_attempts_expired_leases_with_the_error_kept() {
    let db = TestDb::new().await;
    let mut model = db::NewModel::new("m1", "/base");
    model.config.queue.max_attempts = 2;
    db::create_model(&db.pool, &model).await.unwrap();
    insert_groups(&db.pool, "m1", 1).await;
    let mut clock = Utc::now();
    for attempt in 1..=2 {
        let claim =
            db::claim_groups(&db.pool, &ClaimParams { now: Some(clock), ..params("m1", "w", 1) }).await.unwrap();
        assert_eq!(claim.groups.len(), 1, "attempt {attempt} claims the group");
        clock += TimeDelta::seconds(61);
        db::rescue_expired(&db.pool, Some(clock)).await.unwrap();
        clock += TimeDelta::seconds(200); // past the retry backoff
    }
    let id: GroupId = sqlx::query_scalar("SELECT id FROM trainq.groups").fetch_one(&db.pool).await.unwrap();
    let (state, attempts, error) = state_of(&db, id).await;
    assert_eq!((state.as_str(), attempts), ("failed", 2));
    assert_eq!(error.as_deref(), Some("lease expired (attempt 2 of 2, worker w)"));
    assert!(db::claim_groups(&db.pool, &params("m1", "w", 1)).await.unwrap().groups.is_empty());
}

#[tokio::test]
async fn released_groups_return_to_pending_until_max_attempts() {
    let db = TestDb::new().await;
    db.create_model("m1").await; // default max_attempts = 3
    insert_groups(&db.pool, "m1", 1).await;
    for attempt in 1..=3 {
        // Released groups back off (10 s, then 20 s) before they can be claimed again.
        let after_backoff = Some(Utc::now() + TimeDelta::seconds(100 * attempt as i64));
        let claim =
            db::claim_groups(&db.pool, &ClaimParams { now: after_backoff, ..params("m1", "w", 1) }).await.unwrap();
        let ids = [claim.groups[0].id];
        db::release_groups(&db.pool, claim.token, &ids, "cuda out of memory").await.unwrap();
        let (state, attempts, _) = state_of(&db, ids[0]).await;
        assert_eq!(attempts, attempt);
        assert_eq!(state, if attempt < 3 { "pending" } else { "failed" });
    }
}

#[tokio::test]
async fn unclaimed_groups_return_to_pending_without_counting_an_attempt_and_only_for_their_token() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    insert_groups(&db.pool, "m1", 1).await;
    for _ in 0..5 {
        let claim = db::claim_groups(&db.pool, &params("m1", "w", 1)).await.unwrap();
        let ids = [claim.groups[0].id];
        let stranger = db::unclaim_groups(&db.pool, trainq_queue::ClaimToken::new(), &ids).await;
        assert!(matches!(stranger, Err(Error::LostClaim { .. })), "{stranger:?}");
        db::unclaim_groups(&db.pool, claim.token, &ids).await.unwrap();
        assert_eq!(state_of(&db, ids[0]).await, ("pending".to_string(), 0, None));
    }
}

fn step_record(model: &str, step: i64, worker: &str, claimed: usize) -> StepRecord {
    StepRecord {
        model: model.into(),
        step: StepNumber(step),
        worker_id: worker.into(),
        async_weight_syncing: false,
        started_at: Utc::now().trunc_subsecs(6), // PostgreSQL keeps microseconds
        finished_at: Utc::now().trunc_subsecs(6) + TimeDelta::seconds(1),
        groups_claimed: claimed as i32,
        groups_trained: 1,
        groups_skipped: json!({"zero_variance": 1}),
        trajectories: 2,
        tokens: 321,
        loss: Some(0.25),
        loss_parts: json!({"pg": 0.25}),
        grad_norm: Some(1.5),
        learning_rate: Some(1e-5),
        reward_mean: Some(0.5),
        reward_std_mean: Some(0.5),
        policy_lag_min: Some(1),
        policy_lag_max: Some(1),
        timings: json!({"train": 0.1}),
        devices: json!(["cpu"]),
        checkpoint_uri: Some(format!("file:///ckpt/{model}/{step}/")),
        checkpoint_sha256: Some("ab".repeat(32)),
        groups_wanted: Some(claimed as i32),
        reward_mean_claimed: Some(0.25),
        reward_mean_skipped: Some(0.0),
        logprob_coverage: Some(1.0),
        importance_ratio_mean: Some(1.0),
    }
}

#[tokio::test]
async fn commit_step_records_everything_in_one_fenced_transaction_and_notifies() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    insert_groups(&db.pool, "m1", 2).await;
    let mut listener = sqlx::postgres::PgListener::connect_with(&db.pool).await.unwrap();
    listener.listen("trainq_checkpoints").await.unwrap();
    let claim = db::claim_groups(&db.pool, &params("m1", "w", 2)).await.unwrap();
    let (trained, skipped) = (claim.groups[0].id, claim.groups[1].id);
    let skip =
        SkippedGroup { id: skipped, reason: SkipReason::ZeroVariance, std: Some(0.0), detail: Some("all 1".into()) };
    let step = step_record("m1", 1, "w", 2);
    let ckpt = CheckpointRecord {
        model: "m1".into(),
        step: StepNumber(1),
        uri: "file:///ckpt/m1/1/".into(),
        format: "peft_lora".into(),
        bytes: 1234,
        sha256: "ab".repeat(32),
        manifest: json!({"files": []}),
    };
    db::commit_step(&db.pool, &step, Some(&ckpt), claim.token, &[trained], &[skip]).await.unwrap();
    let note = tokio::time::timeout(Duration::from_secs(10), listener.recv()).await.unwrap().unwrap();
    let payload: serde_json::Value = serde_json::from_str(note.payload()).unwrap();
    // A hint only (any role can notify this channel): the URI is read from latest_checkpoint.
    assert_eq!(payload, json!({"model": "m1", "step": 1}));
    assert_eq!(db::get_model(&db.pool, "m1").await.unwrap().current_step, StepNumber(1));
    assert_eq!(db::list_steps(&db.pool, "m1", 10).await.unwrap(), vec![step]);
    assert_eq!(db::latest_checkpoint(&db.pool, "m1").await.unwrap(), Some(ckpt));
    let row: (String, Option<i64>) = sqlx::query_as("SELECT state::text, step FROM trainq.groups WHERE id = $1")
        .bind(trained)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(row, ("trained".into(), Some(1)));
    let row: (String, String, Option<f64>, Option<String>) =
        sqlx::query_as("SELECT state::text, skip_reason::text, skip_std, skip_detail FROM trainq.groups WHERE id = $1")
            .bind(skipped)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(row, ("skipped".into(), "zero_variance".into(), Some(0.0), Some("all 1".into())));
    let counts = db::queue_counts(&db.pool, Some("m1")).await.unwrap();
    assert_eq!((counts[0].trained, counts[0].skipped.get("zero_variance").copied()), (1, Some(1)));
}

#[tokio::test]
async fn the_heartbeat_keeps_a_lease_alive_and_reports_a_lost_claim() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    insert_groups(&db.pool, "m1", 1).await;
    let claim = db::claim_groups(&db.pool, &ClaimParams { lease_seconds: 1.0, ..params("m1", "w", 1) }).await.unwrap();
    let id = claim.groups[0].id;
    let lease = |pool: sqlx::PgPool| async move {
        sqlx::query_scalar::<_, chrono::DateTime<Utc>>("SELECT lease_expires_at FROM trainq.groups")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let before = lease(db.pool.clone()).await;
    let on_lost = tokio_util::sync::CancellationToken::new();
    let beat = trainq_queue::queue::spawn_lease_heartbeat(
        db.pool.clone(),
        claim.token,
        30.0,
        Duration::from_millis(20),
        on_lost.clone(),
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while lease(db.pool.clone()).await < before + TimeDelta::seconds(20) {
        assert!(tokio::time::Instant::now() < deadline, "heartbeat never extended the lease");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Another worker's rescuer takes the groups away: the heartbeat notices and ends with LostClaim.
    db::rescue_expired(&db.pool, Some(Utc::now() + TimeDelta::seconds(60))).await.unwrap();
    while !beat.is_lost() {
        assert!(tokio::time::Instant::now() < deadline, "heartbeat never noticed the lost claim");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(on_lost.is_cancelled(), "a lost claim cancels the work done under it");
    assert!(matches!(beat.stop().await, Err(Error::LostClaim { .. })));
    assert_eq!(state_of(&db, id).await.0, "pending");
}

async fn submit_versioned(db: &TestDb, model: &str, policy_version: Option<i64>) -> GroupId {
    let group = db::NewGroup {
        model: model.into(),
        trajectories: chat_group(&[0.0, 1.0]),
        policy_version: policy_version.map(StepNumber),
        metadata: json!({}),
    };
    db::submit_group(&db.pool, &group).await.unwrap()
}

#[tokio::test]
async fn a_claim_in_a_policy_window_takes_eligible_groups_first_and_the_too_old_along() {
    let db = TestDb::new().await;
    db.create_model("m1").await;
    let mut old = Vec::new();
    for _ in 0..3 {
        old.push(submit_versioned(&db, "m1", Some(0)).await);
    }
    sqlx::query("UPDATE trainq.models SET current_step = 2").execute(&db.pool).await.unwrap();
    let mut fresh = Vec::new();
    for _ in 0..3 {
        fresh.push(submit_versioned(&db, "m1", Some(2)).await);
    }
    // Unknown age: not on-policy by default (queue.unknown_policy_version = "stale").
    let unknown = submit_versioned(&db, "m1", None).await;

    let window = db::PolicyWindow {
        current_step: StepNumber(2),
        accepted_staleness: 0,
        unknown_policy_version: trainq_queue::config::UnknownPolicyVersion::Stale,
        too_old_limit: 10,
    };
    let counted = db::count_claimable(&db.pool, "m1", &window).await.unwrap();
    assert_eq!((counted.current_step, counted.eligible, counted.too_old), (StepNumber(2), 3, 4));
    assert!(counted.oldest_eligible_age_seconds.is_some_and(|s| s >= 0.0));

    // Eligible groups are counted against the limit; the older ones come along to be skipped.
    let claim =
        db::claim_groups(&db.pool, &ClaimParams { window: Some(window), ..params("m1", "w", 2) }).await.unwrap();
    let mut expected: Vec<GroupId> = old.iter().copied().chain(fresh[..2].iter().copied()).collect();
    expected.push(unknown);
    expected.sort();
    assert_eq!(claim.groups.iter().map(|g| g.id).collect::<Vec<_>>(), expected);
    let counted = db::count_claimable(&db.pool, "m1", &window).await.unwrap();
    assert_eq!((counted.eligible, counted.too_old), (1, 0));

    // With async weight syncing (staleness 2) the version-0 groups would have been eligible.
    let wide = db::PolicyWindow { accepted_staleness: 2, ..window };
    assert_eq!(db::count_claimable(&db.pool, "m1", &wide).await.unwrap().eligible, 1);
}

#[tokio::test]
async fn a_model_can_refuse_groups_of_unknown_age_at_insert() {
    let db = TestDb::new().await;
    let mut cfg = trainq_queue::config::TrainConfig::default();
    cfg.queue.unknown_policy_version = trainq_queue::config::UnknownPolicyVersion::Refuse;
    db::create_model(&db.pool, &db::NewModel { config: cfg, ..db::NewModel::new("strict", "/models/base") })
        .await
        .unwrap();
    db.create_model("default").await;
    let group = |model: &str| db::NewGroup {
        model: model.into(),
        trajectories: chat_group(&[0.0, 1.0]),
        policy_version: None,
        metadata: json!({}),
    };
    let err = db::submit_group(&db.pool, &group("strict")).await.unwrap_err();
    let Error::Database { source, .. } = &err else { panic!("{err:?}") };
    assert_eq!(db::sqlstate::code_of(source).as_deref(), Some(db::sqlstate::POLICY_VERSION_UNKNOWN), "{err}");
    assert!(err.to_string().contains("queue.unknown_policy_version"), "{err}");
    db::submit_group(&db.pool, &db::NewGroup { policy_version: Some(StepNumber(0)), ..group("strict") }).await.unwrap();
    // The default accepts the insert; the worker skips such a group `stale` (a policy window
    // counts it as too old).
    db::submit_group(&db.pool, &group("default")).await.unwrap();
}

#[tokio::test]
async fn kl_on_a_full_fine_tune_is_refused_when_the_model_is_created() {
    let db = TestDb::new().await;
    let mut cfg = trainq_queue::config::TrainConfig { lora: None, ..Default::default() };
    cfg.loss.kl_coef = 0.05;
    let err = db::create_model(&db.pool, &db::NewModel { config: cfg, ..db::NewModel::new("full", "/models/base") })
        .await
        .unwrap_err();
    assert!(err.to_string().contains("loss.kl_coef"), "{err}");
    let models: i64 = sqlx::query_scalar("SELECT count(*) FROM trainq.models").fetch_one(&db.pool).await.unwrap();
    assert_eq!(models, 0);
}
