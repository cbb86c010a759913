//! The worker end to end against real PostgreSQL and a real S3 server (moto): several steps with
//! their records and checkpoints, the seed scenario of zero-variance groups, and stale groups with
//! and without async weight syncing.

mod common;
mod worker_support;

use std::process::Command;
use std::time::Duration;

use object_store::ObjectStoreExt;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use trainq::worker::run_worker;
use trainq_queue::db::skipped_passes::list_skipped_passes;
use trainq_queue::db::steps::{deleted_checkpoint_steps, latest_checkpoint, list_steps};
use trainq_queue::storage::{
    complete_steps, fetch_checkpoint, read_manifest, FetchOptions, RetentionPolicy, MANIFEST_FILE,
};
use trainq_queue::StepNumber;

use common::db::TestDb;
use common::s3::MotoServer;
use worker_support::{build_model, groups, options, register, s3_env, step_rows, submit, tiny_config, WorkerProcess};

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_run_records_its_steps_and_fetch_returns_exactly_what_was_trained() {
    let db = TestDb::new().await;
    let server = MotoServer::start();
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    register(&db.pool, "m", &model_dir, tiny_config(2, 30)).await;
    let varied: &[f64] = &[0.0, 1.0, 0.5];
    submit(&db.pool, "m", &[varied; 6], Some(0)).await;

    let store_url = server.url("run");
    let mut opts = options("m", &store_url, server.store_options(Duration::from_secs(30)), &work.path().join("worker"));
    opts.overrides.async_weight_syncing = Some(true);
    opts.overrides.max_staleness = Some(2);
    opts.max_steps = Some(3);
    // Retention keeps every checkpoint a producer may sample from: max_staleness + 1.
    opts.retention = RetentionPolicy { keep_last: 3, keep_every: 0 };
    let summary = run_worker(&db.pool, &opts, CancellationToken::new()).await.unwrap();
    assert_eq!(summary.steps.len(), 3);
    assert_eq!(summary.abandoned, 0);
    // A fourth step on groups sampled from checkpoint 3; retention then drops checkpoint 1.
    submit(&db.pool, "m", &[varied; 2], Some(3)).await;
    opts.max_steps = Some(1);
    run_worker(&db.pool, &opts, CancellationToken::new()).await.unwrap();

    // Step records: flag, lag (groups sampled from checkpoint 0, then 3), counts, checkpoint.
    let mut steps = list_steps(&db.pool, "m", 10).await.unwrap();
    steps.reverse();
    assert_eq!(steps.iter().map(|s| s.step).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
    for s in &steps {
        assert!(s.async_weight_syncing);
        let lag = if s.step.get() == 4 { 0 } else { s.step.get() - 1 };
        assert_eq!((s.policy_lag_min, s.policy_lag_max), (Some(lag), Some(lag)), "step {}", s.step);
        assert_eq!(s.groups_wanted, Some(2));
        assert_eq!((s.groups_claimed, s.groups_trained, s.trajectories), (2, 2, 6));
        assert!(s.tokens > 0 && s.loss.is_some_and(f64::is_finite) && s.grad_norm.is_some_and(f64::is_finite));
        assert!((s.reward_mean.unwrap() - 0.5).abs() < 1e-9);
        for phase in ["claim", "prepare", "train", "save", "upload"] {
            assert!(s.timings[phase].as_f64().is_some_and(|t| t >= 0.0), "timing {phase} of step {}", s.step);
        }
        assert_eq!(s.checkpoint_uri.as_deref(), Some(format!("{store_url}/m/checkpoints/{:06}/", s.step).as_str()));
    }
    let states = groups(&db.pool, "m").await;
    assert!(states.iter().all(|g| g.state == "trained"), "{states:?}");
    let mut trained_steps: Vec<i64> = states.iter().map(|g| g.step.unwrap()).collect();
    trained_steps.sort();
    assert_eq!(trained_steps, vec![1, 1, 2, 2, 3, 3, 4, 4]);

    // Retention kept the last three in the store and marked step 1's row deleted.
    let store = server.store("run");
    assert_eq!(complete_steps(&store, "m").await.unwrap(), vec![2, 3, 4]);
    assert_eq!(deleted_checkpoint_steps(&db.pool, "m").await.unwrap(), vec![1]);
    let latest = latest_checkpoint(&db.pool, "m").await.unwrap().unwrap();
    assert_eq!(latest.step, 4);

    // The manifest lists the staged files with their sha256; the row holds the manifest's sha256.
    let staged = work.path().join("worker/staging/000004");
    let manifest = read_manifest(&store, "m", StepNumber(4)).await.unwrap();
    assert!(manifest.files.iter().any(|f| f.path == "adapter_model.safetensors"), "{manifest:?}");
    for file in &manifest.files {
        let bytes = std::fs::read(staged.join(&file.path)).unwrap();
        assert_eq!((sha256_hex(&bytes), bytes.len() as u64), (file.sha256.clone(), file.bytes), "{}", file.path);
    }
    let key = store.checkpoint_file("m", StepNumber(4), MANIFEST_FILE);
    let manifest_bytes = store.object_store().get(&key).await.unwrap().bytes().await.unwrap();
    assert_eq!(sha256_hex(&manifest_bytes), latest.sha256);
    assert_eq!(steps[3].checkpoint_sha256.as_deref(), Some(latest.sha256.as_str()));

    // The library fetch returns the staged bytes exactly.
    let fetched = work.path().join("fetched");
    fetch_checkpoint(&store, "m", StepNumber(4), &fetched, &FetchOptions::default(), &|_| {}).await.unwrap();
    assert_same_bytes(&staged, &fetched, &manifest);

    // `trainq checkpoint fetch m` with only the database: latest and the store come from Postgres.
    let by_cli = work.path().join("by-cli");
    let output = Command::new(env!("CARGO_BIN_EXE_trainq"))
        .args(["checkpoint", "fetch", "m", "--to"])
        .arg(&by_cli)
        .env_remove("TRAINQ_STORE")
        .env("DATABASE_URL", db.url(None))
        .envs(s3_env(&server))
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(String::from_utf8_lossy(&output.stdout).contains("fetched m step 4"));
    assert_same_bytes(&staged, &by_cli, &manifest);
}

fn assert_same_bytes(staged: &std::path::Path, fetched: &std::path::Path, manifest: &trainq_queue::storage::Manifest) {
    for file in &manifest.files {
        let (a, b) =
            (std::fs::read(staged.join(&file.path)).unwrap(), std::fs::read(fetched.join(&file.path)).unwrap());
        assert!(a == b, "{} differs from what the worker trained", file.path);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_constant_inside_but_different_across_take_no_step_then_a_mixed_batch_trains() {
    let db = TestDb::new().await;
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    register(&db.pool, "m", &model_dir, tiny_config(4, 30)).await;
    let seed = submit(&db.pool, "m", &[&[0.0, 0.0], &[1.0, 1.0], &[0.5, 0.5], &[0.25, 0.25]], Some(0)).await;

    let store_url = format!("file://{}", work.path().join("store").display());
    let args = ["--max-steps", "1"];
    let mut worker = WorkerProcess::spawn(&db.url(None), "m", &store_url, None, &work.path().join("w"), &[], &args);
    let line = worker.wait_for_line("filter: kept 0 of 4 groups", Duration::from_secs(60));
    assert!(line.contains("zero_variance=4"), "{line}");
    for id in &seed {
        assert!(line.contains(&format!("{id} zero_variance std=0")), "{line}");
    }
    worker.wait_for_line("no step taken: all 4 claimed group(s) were skipped", Duration::from_secs(10));
    let rows = groups(&db.pool, "m").await;
    for row in &rows {
        assert_eq!(
            (row.state.as_str(), row.skip_reason.as_deref(), row.skip_std),
            ("skipped", Some("zero_variance"), Some(0.0))
        );
    }
    assert_eq!(step_rows(&db.pool, "m").await, 0);
    // No step, but a record: saturation shows in the rewards instead of vanishing.
    let passes = list_skipped_passes(&db.pool, "m", 10).await.unwrap();
    assert_eq!(passes.len(), 1, "{passes:?}");
    assert_eq!((passes[0].current_step, passes[0].groups_claimed), (StepNumber(0), 4));
    assert_eq!(passes[0].groups_skipped, serde_json::json!({"zero_variance": 4}));
    // (0 + 0 + 1 + 1 + 0.5 + 0.5 + 0.25 + 0.25) / 8
    assert!((passes[0].reward_mean_claimed.unwrap() - 0.4375).abs() < 1e-9, "{passes:?}");
    assert_eq!(passes[0].reward_std_mean, Some(0.0));

    submit(&db.pool, "m", &[&[0.0, 1.0], &[1.0, 1.0], &[0.0, 0.5], &[0.2, 0.2]], Some(0)).await;
    worker.wait_for_line("step committed", Duration::from_secs(60));
    assert!(worker.wait_exit(Duration::from_secs(30)), "{}", worker.seen.join("\n"));
    let steps = list_steps(&db.pool, "m", 10).await.unwrap();
    assert_eq!(steps.len(), 1);
    assert_eq!((steps[0].step.get(), steps[0].groups_claimed, steps[0].groups_trained), (1, 4, 2));
    assert_eq!(steps[0].groups_skipped, serde_json::json!({"zero_variance": 2}));
    // Rewards of the trained groups, of every claimed group, and of the skipped ones.
    let close = |x: Option<f64>, want: f64| x.is_some_and(|x| (x - want).abs() < 1e-9);
    assert!(close(steps[0].reward_mean, 1.5 / 4.0), "{:?}", steps[0]);
    assert!(close(steps[0].reward_mean_claimed, 3.9 / 8.0), "{:?}", steps[0]);
    assert!(close(steps[0].reward_mean_skipped, 2.4 / 4.0), "{:?}", steps[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_groups_are_skipped_without_async_weight_syncing_and_trained_with_it() {
    let db = TestDb::new().await;
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    for (name, async_weight_syncing) in [("sync", false), ("async", true)] {
        register(&db.pool, name, &model_dir, tiny_config(4, 30)).await;
        let store_url = format!("file://{}", work.path().join("store").display());
        let mut opts = options(name, &store_url, Default::default(), &work.path().join(name));
        opts.overrides.async_weight_syncing = Some(async_weight_syncing);
        opts.overrides.max_staleness = Some(2);
        opts.max_steps = Some(1);
        submit(&db.pool, name, &[&[0.0, 1.0], &[1.0, 0.0]], Some(0)).await;
        run_worker(&db.pool, &opts, CancellationToken::new()).await.unwrap();
        // Now at step 1: two groups from checkpoint 0 (lag 1) and two from checkpoint 1 (lag 0).
        let stale = submit(&db.pool, name, &[&[0.0, 1.0], &[0.0, 0.5]], Some(0)).await;
        submit(&db.pool, name, &[&[1.0, 0.0], &[0.5, 0.0]], Some(1)).await;
        let summary = run_worker(&db.pool, &opts, CancellationToken::new()).await.unwrap();
        assert_eq!(summary.steps.len(), 1);

        let step = &list_steps(&db.pool, name, 1).await.unwrap()[0];
        assert_eq!((step.step.get(), step.async_weight_syncing), (2, async_weight_syncing));
        let rows = groups(&db.pool, name).await;
        let stale_rows: Vec<_> = rows.iter().filter(|r| stale.contains(&r.id)).collect();
        if async_weight_syncing {
            assert_eq!((step.groups_trained, step.policy_lag_min, step.policy_lag_max), (4, Some(0), Some(1)));
            assert_eq!(step.groups_skipped, serde_json::json!({}));
            assert!(stale_rows.iter().all(|r| r.state == "trained" && r.step == Some(2)), "{stale_rows:?}");
        } else {
            assert_eq!((step.groups_trained, step.policy_lag_min, step.policy_lag_max), (2, Some(0), Some(0)));
            assert_eq!(step.groups_skipped, serde_json::json!({"stale": 2}));
            assert!(
                stale_rows.iter().all(|r| r.state == "skipped" && r.skip_reason.as_deref() == Some("stale")),
                "{stale_rows:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_trickle_of_on_policy_groups_forms_one_full_batch() {
    let db = TestDb::new().await;
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    let mut cfg = tiny_config(8, 30);
    cfg.queue.max_batch_wait_seconds = 60.0;
    register(&db.pool, "m", &model_dir, cfg).await;
    let store_url = format!("file://{}", work.path().join("store").display());
    let mut opts = options("m", &store_url, Default::default(), &work.path().join("w"));
    opts.max_steps = Some(1);
    let worker = {
        let (pool, opts) = (db.pool.clone(), opts.clone());
        tokio::spawn(async move { run_worker(&pool, &opts, CancellationToken::new()).await })
    };
    // A producer fleet streaming: eight version-0 groups, one at a time. (The pauses pace the
    // producer; nothing waits on a result with them.)
    for i in 0..8 {
        submit(&db.pool, "m", &[&[0.0, 1.0 + i as f64]], Some(0)).await;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let summary = worker.await.unwrap().unwrap();
    assert_eq!(summary.steps.len(), 1);

    let steps = list_steps(&db.pool, "m", 10).await.unwrap();
    assert_eq!(steps.len(), 1);
    let step = &steps[0];
    assert_eq!((step.step.get(), step.groups_claimed, step.groups_trained), (1, 8, 8));
    assert_eq!((step.groups_wanted, step.groups_skipped.clone()), (Some(8), serde_json::json!({})));
    assert_eq!((step.policy_lag_min, step.policy_lag_max), (Some(0), Some(0)));
    let rows = groups(&db.pool, "m").await;
    assert!(rows.iter().all(|g| g.state == "trained" && g.step == Some(1)), "{rows:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_batch_trains_what_arrived_within_max_batch_wait_and_says_so() {
    let db = TestDb::new().await;
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    let mut cfg = tiny_config(8, 30);
    cfg.queue.max_batch_wait_seconds = 1.0;
    register(&db.pool, "m", &model_dir, cfg).await;
    submit(&db.pool, "m", &[&[0.0, 1.0], &[1.0, 0.0], &[0.5, 0.0]], Some(0)).await;
    let store_url = format!("file://{}", work.path().join("store").display());
    let mut opts = options("m", &store_url, Default::default(), &work.path().join("w"));
    opts.max_steps = Some(1);
    run_worker(&db.pool, &opts, CancellationToken::new()).await.unwrap();

    let step = &list_steps(&db.pool, "m", 1).await.unwrap()[0];
    assert_eq!((step.groups_claimed, step.groups_trained, step.groups_wanted), (3, 3, Some(8)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_without_sampler_logprobs_are_refused_by_default_and_coverage_is_recorded() {
    let db = TestDb::new().await;
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    let pre_tokenized = |reward: f64| {
        serde_json::json!({"prompt_ids": [5, 6], "completion_ids": [7, 8, 9], "logprobs": [-1.0, -0.5, -2.0],
                           "reward": reward})
    };
    let with_logprobs = serde_json::Value::Array(vec![pre_tokenized(0.0), pre_tokenized(1.0)]);
    for (name, allowed) in [("strict", false), ("lenient", true)] {
        let mut cfg = tiny_config(2, 30);
        cfg.loss.allow_training_without_logprobs = allowed;
        register(&db.pool, name, &model_dir, cfg).await;
        let new_group = |trajectories: serde_json::Value| trainq_queue::db::NewGroup {
            model: name.into(),
            trajectories,
            policy_version: Some(StepNumber(0)),
            metadata: serde_json::json!({}),
        };
        let groups_in = [new_group(with_logprobs.clone()), new_group(worker_support::group_of(&[0.0, 1.0]))];
        let ids = trainq_queue::db::groups::submit_groups(&db.pool, &groups_in).await.unwrap();
        let store_url = format!("file://{}", work.path().join("store").display());
        let mut opts = options(name, &store_url, Default::default(), &work.path().join(name));
        opts.max_steps = Some(1);
        run_worker(&db.pool, &opts, CancellationToken::new()).await.unwrap();

        let step = &list_steps(&db.pool, name, 1).await.unwrap()[0];
        let coverage = step.logprob_coverage.unwrap();
        assert!(step.importance_ratio_mean.is_some_and(|r| r.is_finite() && r > 0.0), "{step:?}");
        let chat = trainq_queue::db::group_status(&db.pool, ids[1]).await.unwrap().unwrap();
        if allowed {
            assert_eq!(step.groups_trained, 2);
            assert!(coverage > 0.0 && coverage < 1.0, "{step:?}");
            assert_eq!(chat.state, "trained");
        } else {
            assert_eq!((step.groups_trained, step.groups_skipped.clone()), (1, serde_json::json!({"invalid": 1})));
            assert_eq!(coverage, 1.0);
            assert_eq!((chat.state.as_str(), chat.skip_reason.as_deref()), ("skipped", Some("invalid")));
            let detail: String = sqlx::query_scalar("SELECT skip_detail FROM trainq.groups WHERE id = $1")
                .bind(ids[1])
                .fetch_one(&db.pool)
                .await
                .unwrap();
            assert!(detail.contains("loss.allow_training_without_logprobs"), "{detail}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_trajectories_are_cut_or_masked_and_zero_advantage_ones_dropped_when_configured() {
    use trainq_queue::config::TooLongPolicy;
    let db = TestDb::new().await;
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    // Rewards 0, 1, 0.5: mean 0.5, so the third trajectory has zero advantage. The second has
    // 2 + 80 tokens, over tiny_config's max_seq_len of 64.
    let pre_tokenized = |completion: usize, reward: f64| {
        let ids: Vec<i64> = (0..completion).map(|i| 5 + (i % 4) as i64).collect();
        serde_json::json!({"prompt_ids": [5, 6], "completion_ids": ids, "logprobs": vec![-1.0; completion],
                           "reward": reward})
    };
    let trajectories =
        serde_json::Value::Array(vec![pre_tokenized(3, 0.0), pre_tokenized(80, 1.0), pre_tokenized(3, 0.5)]);
    // (name, too_long, drop zero advantage) -> (trajectories, trained tokens, truncated, masked, dropped)
    let cases = [
        ("cut", TooLongPolicy::Truncate, false, (3, 3 + 62 + 3, 1, 0, 0)),
        ("mask", TooLongPolicy::Mask, false, (2, 3 + 3, 0, 1, 0)),
        ("drop", TooLongPolicy::Truncate, true, (2, 3 + 62, 1, 0, 1)),
        ("skip", TooLongPolicy::SkipGroup, false, (0, 0, 0, 0, 0)),
    ];
    for (name, too_long, drop_zero, expected) in cases {
        let mut cfg = tiny_config(1, 30);
        cfg.too_long = too_long;
        cfg.advantages.drop_zero_advantage_trajectories = drop_zero;
        cfg.queue.max_batch_wait_seconds = 0.0;
        register(&db.pool, name, &model_dir, cfg).await;
        let group = trainq_queue::db::NewGroup {
            model: name.into(),
            trajectories: trajectories.clone(),
            policy_version: Some(StepNumber(0)),
            metadata: serde_json::json!({}),
        };
        let id = trainq_queue::db::groups::submit_groups(&db.pool, &[group]).await.unwrap()[0];
        let store_url = format!("file://{}", work.path().join("store").display());
        let mut opts = options(name, &store_url, Default::default(), &work.path().join(name));
        opts.max_steps = Some(1);
        if too_long == TooLongPolicy::SkipGroup {
            // Nothing trains, so no step ends the run: it stops once the queue stays empty.
            opts.stop_when_idle_for = Some(Duration::from_secs(1));
        }
        run_worker(&db.pool, &opts, CancellationToken::new()).await.unwrap();

        let status = trainq_queue::db::group_status(&db.pool, id).await.unwrap().unwrap();
        if too_long == TooLongPolicy::SkipGroup {
            assert_eq!((status.state.as_str(), status.skip_reason.as_deref()), ("skipped", Some("too_long")));
            assert_eq!(step_rows(&db.pool, name).await, 0);
            continue;
        }
        assert_eq!(status.state, "trained", "{name}");
        let step = &list_steps(&db.pool, name, 1).await.unwrap()[0];
        let parts = &step.loss_parts;
        let got = (
            step.trajectories as usize,
            step.tokens as usize,
            parts["trajectories_truncated"].as_u64().unwrap() as usize,
            parts["trajectories_masked"].as_u64().unwrap() as usize,
            parts["trajectories_zero_advantage_dropped"].as_u64().unwrap() as usize,
        );
        assert_eq!(got, expected, "{name}: {step:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_of_unknown_policy_version_is_skipped_stale_by_default_and_trained_when_accepted() {
    use trainq_queue::config::UnknownPolicyVersion;
    let db = TestDb::new().await;
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    for (name, setting) in [("default", None), ("accept", Some(UnknownPolicyVersion::Accept))] {
        let mut cfg = tiny_config(2, 30);
        if let Some(setting) = setting {
            cfg.queue.unknown_policy_version = setting;
        }
        register(&db.pool, name, &model_dir, cfg).await;
        let unknown = submit(&db.pool, name, &[&[0.0, 1.0]], None).await[0];
        submit(&db.pool, name, &[&[1.0, 0.0]], Some(0)).await;
        let store_url = format!("file://{}", work.path().join("store").display());
        let mut opts = options(name, &store_url, Default::default(), &work.path().join(name));
        opts.max_steps = Some(1);
        run_worker(&db.pool, &opts, CancellationToken::new()).await.unwrap();

        let step = &list_steps(&db.pool, name, 1).await.unwrap()[0];
        let status = trainq_queue::db::group_status(&db.pool, unknown).await.unwrap().unwrap();
        if setting.is_some() {
            assert_eq!((step.groups_trained, step.groups_skipped.clone()), (2, serde_json::json!({})), "{step:?}");
            assert_eq!((status.state.as_str(), status.step), ("trained", Some(StepNumber(1))));
            // The unknown group is left out of the lag columns; the known one has lag 0.
            assert_eq!((step.policy_lag_min, step.policy_lag_max), (Some(0), Some(0)));
        } else {
            assert_eq!((step.groups_trained, step.groups_skipped.clone()), (1, serde_json::json!({"stale": 1})));
            assert_eq!((status.state.as_str(), status.skip_reason.as_deref()), ("skipped", Some("stale")));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cispo_with_arts_epsilons_and_a_sampler_temperature_trains_a_real_step() {
    use trainq_queue::config::LossKind;
    let db = TestDb::new().await;
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    // Sampler log-probs far from the tiny model's: importance ratios well away from 1.
    let pre_tokenized = |reward: f64| {
        serde_json::json!({"prompt_ids": [5, 6], "completion_ids": [7, 8, 9, 10], "logprobs": [-4.0, -0.1, -3.0, -0.2],
                           "reward": reward})
    };
    let trajectories = serde_json::Value::Array(vec![pre_tokenized(0.0), pre_tokenized(1.0), pre_tokenized(0.5)]);
    let mut ratios = Vec::new();
    for (name, temperature) in [("t1", 1.0), ("t07", 0.7)] {
        let mut cfg = tiny_config(1, 30);
        // ART's CISPO defaults: ε = 1 (no lower clip on the weight) and ε_high = 4.
        (cfg.loss.kind, cfg.loss.epsilon, cfg.loss.epsilon_high) = (LossKind::Cispo, 1.0, Some(4.0));
        cfg.loss.sampler_temperature = temperature;
        register(&db.pool, name, &model_dir, cfg).await;
        let group = trainq_queue::db::NewGroup {
            model: name.into(),
            trajectories: trajectories.clone(),
            policy_version: Some(StepNumber(0)),
            metadata: serde_json::json!({}),
        };
        trainq_queue::db::groups::submit_groups(&db.pool, &[group]).await.unwrap();
        let store_url = format!("file://{}", work.path().join("store").display());
        let mut opts = options(name, &store_url, Default::default(), &work.path().join(name));
        opts.max_steps = Some(1);
        let summary = run_worker(&db.pool, &opts, CancellationToken::new()).await.unwrap();
        assert_eq!(summary.steps.len(), 1, "{name}");

        let step = &list_steps(&db.pool, name, 1).await.unwrap()[0];
        assert_eq!((step.groups_trained, step.trajectories, step.tokens), (1, 3, 12), "{name}: {step:?}");
        assert!(step.loss.is_some_and(f64::is_finite), "{name}: {step:?}");
        assert!(step.grad_norm.is_some_and(|g| g.is_finite() && g > 0.0), "{name}: {step:?}");
        let clipped = step.loss_parts["clip_fraction"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&clipped), "{name}: {step:?}");
        ratios.push(step.importance_ratio_mean.unwrap());
    }
    // The trainer divides its logits by the sampler's temperature before comparing log-probs.
    assert!(ratios.iter().all(|r| r.is_finite() && *r > 0.0), "{ratios:?}");
    assert!((ratios[0] - ratios[1]).abs() > 1e-6, "the temperature changes the ratio: {ratios:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_refuses_to_start_when_retention_would_delete_checkpoints_producers_sample_from() {
    let db = TestDb::new().await;
    let work = tempfile::tempdir().unwrap();
    let model_dir = build_model(work.path());
    register(&db.pool, "m", &model_dir, tiny_config(2, 30)).await;
    let store_url = format!("file://{}", work.path().join("store").display());
    let mut opts = options("m", &store_url, Default::default(), &work.path().join("w"));
    opts.overrides.async_weight_syncing = Some(true);
    opts.overrides.max_staleness = Some(5);
    opts.retention = RetentionPolicy { keep_last: 5, keep_every: 0 };
    let err = run_worker(&db.pool, &opts, CancellationToken::new()).await.unwrap_err().to_string();
    assert!(err.contains("retention.keep_last") && err.contains("queue.max_staleness = 5"), "{err}");
    opts.retention.keep_last = 6;
    opts.max_steps = Some(0);
    run_worker(&db.pool, &opts, CancellationToken::new()).await.unwrap();
}
