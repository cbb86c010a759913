//! Two workers on one model, concurrently against one database and one S3 store: claims are
//! disjoint, so no group is trained twice, and the steps table has one row per step.

mod common;
mod worker_support;

use std::collections::HashSet;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use trainq::worker::run_worker;
use trainq_queue::db::list_workers;
use trainq_queue::db::steps::list_steps;

use common::db::TestDb;
use common::s3::MotoServer;
use worker_support::{build_model, groups, options, register, submit, tiny_config, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_on_one_model_never_train_the_same_group() {
    let db = TestDb::new().await;
    let server = MotoServer::start();
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    let mut cfg = tiny_config(2, 30);
    // Both workers may train the same step number; the loser's commit fails and its groups go
    // back to the queue, so give them room to be claimed again.
    cfg.queue.max_attempts = 10;
    cfg.queue.async_weight_syncing = true;
    cfg.queue.max_staleness = 100;
    register(&db.pool, "m", &model_dir, cfg).await;

    let store_url = server.url("two");
    let runs = ["a", "b"].map(|id| {
        let mut opts = options("m", &store_url, server.store_options(Duration::from_secs(30)), &work.path().join(id));
        opts.worker_id = format!("worker-{id}");
        opts.stop_when_idle_for = Some(Duration::from_secs(1));
        // Retention keeps every checkpoint a producer may still sample from (max_staleness 100).
        opts.retention.keep_last = 101;
        let pool = db.pool.clone();
        tokio::spawn(async move { run_worker(&pool, &opts, CancellationToken::new()).await })
    });
    // Submit once both are up, so that both wait on the queue when the groups arrive.
    wait_until("both workers registered", Duration::from_secs(30), || async {
        list_workers(&db.pool, Some("m")).await.unwrap().len() == 2
    })
    .await;
    let varied: &[f64] = &[0.0, 1.0];
    let zero: &[f64] = &[1.0, 1.0];
    let mut batch = vec![varied; 14];
    batch[3] = zero;
    batch[9] = zero;
    submit(&db.pool, "m", &batch, Some(0)).await;
    let mut committed = Vec::new();
    let mut passes = Vec::new();
    for run in runs {
        let summary = run.await.unwrap().unwrap();
        committed.extend(summary.steps.iter().map(|s| (s.step, s.worker_id.clone())));
        passes.push(summary.steps.len() + summary.abandoned + summary.all_skipped_passes);
    }
    eprintln!("steps by worker: {committed:?}; passes with a claim per worker: {passes:?}");
    assert!(passes.iter().all(|&n| n > 0), "both workers claimed groups: {passes:?}");

    let rows = groups(&db.pool, "m").await;
    assert_eq!(rows.len(), 14);
    assert!(rows.iter().all(|g| g.state == "trained" || g.state == "skipped"), "{rows:?}");
    assert_eq!(rows.iter().filter(|g| g.state == "skipped").count(), 2);
    let steps = list_steps(&db.pool, "m", 100).await.unwrap();
    let numbers: HashSet<i64> = steps.iter().map(|s| s.step.get()).collect();
    assert_eq!(numbers.len(), steps.len(), "no duplicate step rows");
    assert_eq!(committed.len(), steps.len(), "every committed step is one row: {committed:?}");
    // Each trained group belongs to exactly one recorded step, and the counts add up.
    let trained: usize = steps.iter().map(|s| s.groups_trained as usize).sum();
    assert_eq!(trained, rows.iter().filter(|g| g.state == "trained").count());
    assert!(rows.iter().filter(|g| g.state == "trained").all(|g| g.step.is_some_and(|s| numbers.contains(&s))));
}
