//! The worker under faults, with the real `trainq worker` binary paused at a step phase through
//! its test hook (`TRAINQ_FAULT_PAUSE_AT`): kill -9 in training and in upload (no step row, no
//! group lost or stuck, a restarted worker completes the step, each group trained once), and the
//! S3 server stopped during upload (the upload is retried, the step recorded once and whole), and
//! a lost commit race (another worker committed the step first: the groups go back to the queue
//! without counting an attempt), also when the next step already trained on top of the lost one;
//! a claim lost in the middle of a step (the step stops: nothing is trained on, saved or
//! uploaded, and the log names the claim); and, with async weight syncing, the next batch
//! claimed while a step trains.

mod common;
mod worker_support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use object_store::ObjectStoreExt;
use sha2::{Digest, Sha256};
use trainq::worker::fault_hook::{FAULT_PAUSED_MARKER, FAULT_PAUSE_AT_ENV, FAULT_RESUME_FILE_ENV};
use trainq_queue::db::steps::{latest_checkpoint, list_steps};
use trainq_queue::db::{claim_groups, commit_step, rescue_expired, ClaimParams, StepRecord};
use trainq_queue::storage::{complete_steps, read_manifest, MANIFEST_FILE};
use trainq_queue::{ClaimToken, GroupId};

use common::db::TestDb;
use common::s3::MotoServer;
use worker_support::{build_model, groups, register, step_rows, submit, tiny_config, wait_until, WorkerProcess};

/// Lease of the groups in these tests: short, so that a killed worker's claim expires quickly.
const LEASE_SECONDS: i64 = 3;
const START_LIMIT: Duration = Duration::from_secs(60);

async fn kill_nine_at(phase: &str) {
    let db = TestDb::new().await;
    let server = MotoServer::start();
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    register(&db.pool, "m", &model_dir, tiny_config(2, LEASE_SECONDS)).await;
    submit(&db.pool, "m", &[&[0.0, 1.0], &[1.0, 0.5]], Some(0)).await;
    let store_url = server.url("kill");
    let (url, args) = (db.url(None), ["--max-steps", "1"]);

    let pause = [(FAULT_PAUSE_AT_ENV, phase)];
    let mut first = WorkerProcess::spawn(&url, "m", &store_url, Some(&server), &work.path().join("w1"), &pause, &args);
    first.wait_for_line(&format!("{FAULT_PAUSED_MARKER} phase={phase} step=1"), START_LIMIT);
    first.kill9();

    assert_eq!(step_rows(&db.pool, "m").await, 0);
    assert!(
        groups(&db.pool, "m").await.iter().all(|g| g.state == "claimed"),
        "the killed worker's claim stays until its lease ends"
    );
    // The rescuer's query returns the groups once the lease has expired.
    wait_until("the expired claim is rescued", Duration::from_secs(30), || async {
        rescue_expired(&db.pool, None).await.unwrap();
        groups(&db.pool, "m").await.iter().all(|g| g.state == "pending")
    })
    .await;
    assert!(groups(&db.pool, "m").await.iter().all(|g| g.attempts == 1));

    let mut second = WorkerProcess::spawn(&url, "m", &store_url, Some(&server), &work.path().join("w2"), &[], &args);
    assert!(second.wait_exit(START_LIMIT), "{}", second.seen.join("\n"));
    let rows = groups(&db.pool, "m").await;
    assert!(rows.iter().all(|g| g.state == "trained" && g.step == Some(1)), "{rows:?}");
    let steps = list_steps(&db.pool, "m", 10).await.unwrap();
    assert_eq!(steps.iter().map(|s| (s.step.get(), s.groups_trained)).collect::<Vec<_>>(), vec![(1, 2)]);
    assert_eq!(complete_steps(&server.store("kill"), "m").await.unwrap(), vec![1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_in_training_leaves_no_step_and_a_restarted_worker_completes_it() {
    kill_nine_at("train").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_in_upload_leaves_no_step_and_a_restarted_worker_completes_it() {
    kill_nine_at("upload").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_outage_during_upload_is_retried_and_the_step_is_recorded_once_and_whole() {
    let db = TestDb::new().await;
    let mut server = MotoServer::start();
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    register(&db.pool, "m", &model_dir, tiny_config(2, 30)).await;
    submit(&db.pool, "m", &[&[0.0, 1.0], &[1.0, 0.5]], Some(0)).await;
    let store_url = server.url("outage");
    let pause = Pause::at("upload", work.path());
    let env = pause.env();
    let mut worker = WorkerProcess::spawn(
        &db.url(None),
        "m",
        &store_url,
        Some(&server),
        &work.path().join("w"),
        &env,
        &["--max-steps", "1"],
    );
    worker.wait_for_line(&format!("{FAULT_PAUSED_MARKER} phase=upload"), START_LIMIT);

    server.kill();
    pause.resume();
    // object_store logs each failed attempt it is about to retry.
    worker.wait_for_line("Encountered transport error", Duration::from_secs(30));
    assert_eq!(step_rows(&db.pool, "m").await, 0, "nothing is recorded while the store is down");
    assert!(groups(&db.pool, "m").await.iter().all(|g| g.state == "claimed"));

    server.restart(); // same port, fresh and empty bucket
    assert!(worker.wait_exit(START_LIMIT), "{}", worker.seen.join("\n"));
    let steps = list_steps(&db.pool, "m", 10).await.unwrap();
    assert_eq!(steps.len(), 1);
    assert!(groups(&db.pool, "m").await.iter().all(|g| g.state == "trained" && g.step == Some(1) && g.attempts == 0));
    // Whole: every file of the manifest is in the restarted server, the row's sha256 is the manifest's.
    let store = server.store("outage");
    let manifest = read_manifest(&store, "m", trainq_queue::StepNumber(1)).await.unwrap();
    for file in &manifest.files {
        let bytes = store
            .object_store()
            .get(&store.checkpoint_file("m", trainq_queue::StepNumber(1), &file.path))
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        assert_eq!(hex::encode(Sha256::digest(&bytes)), file.sha256, "{}", file.path);
    }
    let key = store.checkpoint_file("m", trainq_queue::StepNumber(1), MANIFEST_FILE);
    let manifest_bytes = store.object_store().get(&key).await.unwrap().bytes().await.unwrap();
    let row = latest_checkpoint(&db.pool, "m").await.unwrap().unwrap();
    assert_eq!((row.step.get(), hex::encode(Sha256::digest(&manifest_bytes))), (1, row.sha256.clone()));
    assert_eq!(steps[0].checkpoint_sha256, Some(row.sha256));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_commit_race_gives_the_groups_back_without_counting_an_attempt() {
    let db = TestDb::new().await;
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    let mut cfg = tiny_config(2, 30);
    cfg.queue.async_weight_syncing = true;
    cfg.queue.max_staleness = 1;
    register(&db.pool, "m", &model_dir, cfg).await;
    let ours = submit(&db.pool, "m", &[&[0.0, 1.0], &[1.0, 0.5]], Some(0)).await;
    let store_url = format!("file://{}", work.path().join("store").display());
    let pause = Pause::at("upload", work.path());
    let env = pause.env();
    let (url, args) = (db.url(None), ["--max-steps", "1", "--keep-last", "2"]);
    let mut worker = WorkerProcess::spawn(&url, "m", &store_url, None, &work.path().join("w"), &env, &args);
    worker.wait_for_line(&format!("{FAULT_PAUSED_MARKER} phase=upload step=1"), START_LIMIT);

    // Meanwhile another worker commits step 1, on a group of its own.
    another_worker_commits_step_one(&db.pool).await;

    pause.resume();
    let line = worker.wait_for_line("step abandoned", START_LIMIT);
    assert!(line.contains("was committed by another worker"), "{line}");
    // The race was not the groups' fault: they went back with no attempt counted, and the same
    // worker trained them in the next step.
    assert!(worker.wait_exit(START_LIMIT), "{}", worker.seen.join("\n"));
    let rows = groups(&db.pool, "m").await;
    for row in rows.iter().filter(|g| ours.contains(&g.id)) {
        assert_eq!((row.state.as_str(), row.step, row.attempts), ("trained", Some(2), 0), "{rows:?}");
    }
    let steps = list_steps(&db.pool, "m", 10).await.unwrap();
    assert_eq!(steps.iter().map(|s| s.step.get()).collect::<Vec<_>>(), vec![2, 1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_trained_while_the_previous_commit_is_lost_goes_back_without_counting_an_attempt() {
    // With async weight syncing, step 2 trains while step 1 uploads; when step 1's commit is
    // lost, step 2 trained on weights that are nobody's and must be given back too.
    let db = TestDb::new().await;
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    let mut cfg = tiny_config(1, 30);
    cfg.queue.async_weight_syncing = true;
    cfg.queue.max_staleness = 2;
    register(&db.pool, "m", &model_dir, cfg).await;
    let ours = submit(&db.pool, "m", &[&[0.0, 1.0], &[1.0, 0.5]], Some(0)).await;
    let store_url = format!("file://{}", work.path().join("store").display());
    let pause = Pause::at("upload", work.path());
    let env = pause.env();
    let (url, args) = (db.url(None), ["--max-steps", "2", "--keep-last", "3"]);
    let mut worker = WorkerProcess::spawn(&url, "m", &store_url, None, &work.path().join("w"), &env, &args);
    worker.wait_for_line(&format!("{FAULT_PAUSED_MARKER} phase=upload step=1"), START_LIMIT);
    // Step 1 is held before its upload; the next step claims the second group meanwhile.
    wait_until("the next step claims while step 1 is held", START_LIMIT, || async {
        groups(&db.pool, "m").await.iter().all(|g| g.state == "claimed")
    })
    .await;

    another_worker_commits_step_one(&db.pool).await;

    pause.resume();
    let line = worker.wait_for_line("step abandoned", START_LIMIT);
    assert!(line.contains("was committed by another worker"), "{line}");
    let line = worker.wait_for_line("step abandoned", START_LIMIT);
    assert!(line.contains("step 1 was not committed"), "{line}");
    assert!(worker.wait_exit(START_LIMIT), "{}", worker.seen.join("\n"));
    let rows = groups(&db.pool, "m").await;
    for row in rows.iter().filter(|g| ours.contains(&g.id)) {
        assert_eq!((row.state.as_str(), row.attempts), ("trained", 0), "{rows:?}");
    }
    let steps = list_steps(&db.pool, "m", 10).await.unwrap();
    let by = steps.iter().map(|s| (s.step.get(), s.worker_id == "other")).collect::<Vec<_>>();
    assert_eq!(by, vec![(3, false), (2, false), (1, true)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_async_weight_syncing_the_next_batch_is_claimed_while_a_step_trains() {
    let db = TestDb::new().await;
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    let mut cfg = tiny_config(1, 30);
    cfg.queue.async_weight_syncing = true;
    cfg.queue.max_staleness = 2;
    register(&db.pool, "m", &model_dir, cfg).await;
    let ours = submit(&db.pool, "m", &[&[0.0, 1.0], &[1.0, 0.5], &[0.2, 0.4]], Some(0)).await;
    let store_url = format!("file://{}", work.path().join("store").display());
    let pause = Pause::at("train", work.path());
    let env = pause.env();
    let (url, args) = (db.url(None), ["--max-steps", "3", "--keep-last", "3"]);
    let mut worker = WorkerProcess::spawn(&url, "m", &store_url, None, &work.path().join("w"), &env, &args);
    worker.wait_for_line(&format!("{FAULT_PAUSED_MARKER} phase=train step=1"), START_LIMIT);
    // Step 1 is held before its optimizer step; step 2's batch is claimed and prepared meanwhile.
    wait_until("the next batch is claimed while step 1 trains", START_LIMIT, || async {
        groups(&db.pool, "m").await.iter().filter(|g| g.state == "claimed").count() == 2
    })
    .await;
    pause.resume();
    assert!(worker.wait_exit(START_LIMIT), "{}", worker.seen.join("\n"));
    let rows = groups(&db.pool, "m").await;
    for row in rows.iter().filter(|g| ours.contains(&g.id)) {
        assert_eq!((row.state.as_str(), row.attempts), ("trained", 0), "{rows:?}");
    }
    let steps = list_steps(&db.pool, "m", 10).await.unwrap();
    assert_eq!(
        steps.iter().map(|s| (s.step.get(), s.groups_trained)).collect::<Vec<_>>(),
        vec![(3, 1), (2, 1), (1, 1)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_lost_in_the_middle_of_a_step_stops_it_before_it_trains_saves_or_uploads() {
    let db = TestDb::new().await;
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    // A 3 s lease: the worker's heartbeat renews it every second.
    register(&db.pool, "m", &model_dir, tiny_config(2, LEASE_SECONDS)).await;
    let mut ours = submit(&db.pool, "m", &[&[0.0, 1.0], &[1.0, 0.5]], Some(0)).await;
    ours.sort();
    let store = work.path().join("store");
    let store_url = format!("file://{}", store.display());
    let pause = Pause::at("train", work.path());
    let env = pause.env();
    let worker_dir = work.path().join("w");
    let mut worker =
        WorkerProcess::spawn(&db.url(None), "m", &store_url, None, &worker_dir, &env, &["--max-steps", "1"]);
    // Claimed and prepared, held just before the optimizer step.
    worker.wait_for_line(&format!("{FAULT_PAUSED_MARKER} phase=train step=1"), START_LIMIT);
    let lost = claim_tokens(&db.pool, &ours).await;
    assert_eq!(lost.len(), 1, "one claim holds both groups: {lost:?}");

    // Another session takes the groups: a rescuer whose clock runs an hour ahead returns them,
    // and another worker claims them under a token of its own.
    // Its clock is past the retry backoff of the rescued groups too.
    let later = chrono::Utc::now() + chrono::TimeDelta::hours(1);
    rescue_expired(&db.pool, Some(later)).await.unwrap();
    let params = ClaimParams {
        model: "m".into(),
        worker_id: "other".into(),
        limit: 2,
        lease_seconds: 600.0,
        now: Some(later + chrono::TimeDelta::minutes(1)),
        window: None,
    };
    let theirs = claim_groups(&db.pool, &params).await.unwrap();
    let mut taken: Vec<GroupId> = theirs.groups.iter().map(|g| g.id).collect();
    taken.sort();
    assert_eq!(taken, ours);

    // The worker's next heartbeat finds its claim gone; only then is the step let go on.
    let line = worker.wait_for_line("lease heartbeat stopped", Duration::from_secs(30));
    assert!(line.contains("lost the claim") && line.contains(&lost[0].to_string()), "{line}");
    pause.resume();
    let line = worker.wait_for_line("step abandoned", START_LIMIT);
    assert!(line.contains("lost the claim on 2 group(s)"), "{line}");
    assert!(line.contains(&lost[0].to_string()), "the line names the lost claim: {line}");

    // Stopped: no checkpoint saved (the staging directory of step 1 is made after training), none
    // uploaded, no step row; the groups stay with the session that took them, untouched.
    assert!(!worker_dir.join("staging").join("000001").exists(), "the step went on to save a checkpoint");
    let uploaded: Vec<_> = walk(&store);
    assert!(uploaded.is_empty(), "uploaded {uploaded:?}");
    assert_eq!(step_rows(&db.pool, "m").await, 0);
    assert_eq!(claim_tokens(&db.pool, &ours).await, vec![theirs.token]);
    for row in groups(&db.pool, "m").await {
        assert_eq!((row.state.as_str(), row.attempts), ("claimed", 1), "{row:?}");
    }
    assert!(!worker.seen.iter().any(|l| l.contains("step committed")), "{}", worker.seen.join("\n"));
}

/// The distinct claim tokens that hold `ids` now.
async fn claim_tokens(pool: &sqlx::PgPool, ids: &[GroupId]) -> Vec<ClaimToken> {
    let ids: Vec<uuid::Uuid> = ids.iter().map(|g| g.0).collect();
    sqlx::query_scalar("SELECT DISTINCT claim_token FROM trainq.groups WHERE id = ANY($1) AND claim_token IS NOT NULL")
        .bind(ids)
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Every file under `dir` (none when it does not exist).
fn walk(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries.flatten().flat_map(|e| if e.path().is_dir() { walk(&e.path()) } else { vec![e.path()] }).collect()
}

/// The fault hook's pause at a phase of the worker's first step, lifted by [`Pause::resume`].
struct Pause {
    phase: &'static str,
    file: PathBuf,
    file_env: String,
}

impl Pause {
    fn at(phase: &'static str, dir: &Path) -> Pause {
        let file = dir.join("resume");
        let file_env = file.to_str().unwrap().to_string();
        Pause { phase, file, file_env }
    }

    /// The worker's environment for the pause.
    fn env(&self) -> [(&str, &str); 2] {
        [(FAULT_PAUSE_AT_ENV, self.phase), (FAULT_RESUME_FILE_ENV, self.file_env.as_str())]
    }

    /// Lets the paused worker go on.
    fn resume(&self) {
        std::fs::write(&self.file, b"").unwrap();
    }
}

/// Another worker claims a group of its own and commits step 1 with it.
async fn another_worker_commits_step_one(pool: &sqlx::PgPool) {
    let theirs = submit(pool, "m", &[&[0.0, 1.0]], Some(0)).await;
    let params = ClaimParams {
        model: "m".into(),
        worker_id: "other".into(),
        limit: 1,
        lease_seconds: 60.0,
        now: None,
        window: None,
    };
    let claim = claim_groups(pool, &params).await.unwrap();
    assert_eq!(claim.groups.iter().map(|g| g.id).collect::<Vec<_>>(), theirs);
    commit_step(pool, &other_step(), None, claim.token, &theirs, &[]).await.unwrap();
}

/// Step 1 as another worker recorded it (no checkpoint: the race is about the step number).
fn other_step() -> StepRecord {
    let now = chrono::Utc::now();
    StepRecord {
        model: "m".into(),
        step: trainq_queue::StepNumber(1),
        worker_id: "other".into(),
        async_weight_syncing: true,
        started_at: now,
        finished_at: now,
        groups_claimed: 1,
        groups_wanted: Some(1),
        groups_trained: 1,
        groups_skipped: serde_json::json!({}),
        trajectories: 2,
        tokens: 1,
        loss: None,
        loss_parts: serde_json::json!({}),
        grad_norm: None,
        learning_rate: None,
        reward_mean: Some(0.5),
        reward_mean_claimed: Some(0.5),
        reward_mean_skipped: None,
        logprob_coverage: None,
        importance_ratio_mean: None,
        reward_std_mean: Some(0.5),
        policy_lag_min: Some(0),
        policy_lag_max: Some(0),
        timings: serde_json::json!({}),
        devices: serde_json::json!([]),
        checkpoint_uri: None,
        checkpoint_sha256: None,
    }
}
