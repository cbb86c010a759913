//! `trainq worker` with data-parallel ranks, run on the CPU as two in-process ranks (the GPU
//! path differs only in the collective): the same steps, records and adapters as one engine,
//! including a restart that resumes every rank from the latest checkpoint.

mod common;
mod worker_support;

use std::collections::HashMap;
use std::path::Path;

use tch::Tensor;
use tokio_util::sync::CancellationToken;
use trainq::worker::{run_worker, Placement};
use trainq_engine::tch::Device;
use trainq_queue::db::steps::{list_steps, StepRecord};
use trainq_queue::storage::StoreOptions;

use common::db::TestDb;
use worker_support::{build_model, groups, options, register, submit, tiny_config};

fn adapter(work: &Path, worker: &str, step: i64) -> HashMap<String, Tensor> {
    let file = work.join(worker).join(format!("staging/{step:06}/adapter_model.safetensors"));
    Tensor::read_safetensors(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display())).into_iter().collect()
}

async fn run(db: &TestDb, work: &Path, model: &str, placement: Placement, steps: u64) {
    let store = format!("file://{}", work.join("store").display());
    let mut opts = options(model, &store, StoreOptions::default(), &work.join(model));
    opts.placement = placement;
    opts.max_steps = Some(steps);
    let summary = run_worker(&db.pool, &opts, CancellationToken::new()).await.unwrap();
    assert_eq!((summary.steps.len() as u64, summary.abandoned), (steps, 0), "{model}");
}

fn assert_close(a: f64, b: f64, what: &str) {
    assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{what}: {a} vs {b}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_cpu_ranks_train_and_record_what_one_engine_does() {
    let db = TestDb::new().await;
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    // Small micro-batches so each step has several to split between the ranks.
    let mut cfg = tiny_config(3, 30);
    cfg.max_tokens_per_micro_batch = 64;
    // The groups carry no policy_version (all are submitted up front): train them anyway.
    cfg.queue.unknown_policy_version = trainq_queue::config::UnknownPolicyVersion::Accept;
    // Identical groups: which ones a claim picks cannot change what a step trains on.
    let varied: &[f64] = &[0.0, 1.0, 0.25, 0.5];
    for model in ["single", "ranks"] {
        register(&db.pool, model, &model_dir, cfg.clone()).await;
        submit(&db.pool, model, &[varied; 9], None).await;
    }

    // Two steps, then a restart that resumes from checkpoint 2 for the third.
    for (model, parallel) in [("single", Placement::One(Device::Cpu)), ("ranks", Placement::CpuRanks(2))] {
        run(&db, work.path(), model, parallel.clone(), 2).await;
        run(&db, work.path(), model, parallel, 1).await;
    }

    let records = |model: &'static str| {
        let pool = db.pool.clone();
        async move {
            let mut steps: Vec<StepRecord> = list_steps(&pool, model, 10).await.unwrap();
            steps.reverse();
            steps
        }
    };
    let (single, ranks) = (records("single").await, records("ranks").await);
    assert_eq!(ranks.iter().map(|s| s.step).collect::<Vec<_>>(), vec![1, 2, 3]);
    for (a, b) in single.iter().zip(&ranks) {
        assert_eq!(
            (a.groups_trained, a.trajectories, a.tokens),
            (b.groups_trained, b.trajectories, b.tokens),
            "step {}",
            a.step
        );
        assert_close(a.loss.unwrap(), b.loss.unwrap(), &format!("loss of step {}", a.step));
        assert_close(a.grad_norm.unwrap(), b.grad_norm.unwrap(), &format!("grad norm of step {}", a.step));
        assert_eq!(b.loss_parts["micro_batches"], a.loss_parts["micro_batches"], "step {}", a.step);
        assert!(a.loss_parts["micro_batches"].as_f64().unwrap() >= 2.0, "several micro-batches to split");
        assert_eq!(b.devices, serde_json::json!(["cpu", "cpu"]));
    }
    assert!(groups(&db.pool, "ranks").await.iter().all(|g| g.state == "trained"));

    // Rank 0's checkpoint after each step equals the single engine's adapter.
    for step in [2, 3] {
        let (one, two) = (adapter(work.path(), "single", step), adapter(work.path(), "ranks", step));
        assert_eq!(one.len(), two.len());
        for (name, t) in &one {
            let diff = (t - &two[name]).abs().max().double_value(&[]);
            assert!(diff <= 1e-5, "step {step} {name}: max |diff| {diff}");
        }
        let moved = one.values().any(|t| t.abs().max().double_value(&[]) > 0.0);
        assert!(moved, "the adapters trained");
    }

    let devices: serde_json::Value =
        sqlx::query_scalar("SELECT devices FROM trainq.workers WHERE model = 'ranks' LIMIT 1")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(devices, serde_json::json!(["cpu", "cpu"]));
}
