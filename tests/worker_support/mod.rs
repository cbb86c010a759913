//! Worker tests' fixtures: the demo's tiny Qwen3-shaped model registered as a model with a short
//! lease, groups of chat trajectories the demo tokenizer can encode, the state of every group,
//! worker options pointed at a test store, the real `trainq worker` binary, and polling a
//! condition with a deadline.
//! (Kept apart from `common`, which the queue crate's tests share without libtorch.)
#![allow(dead_code, unreachable_pub)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sqlx::PgPool;
use tch::Device;
use trainq::worker::WorkerOptions;
use trainq_queue::config::{LoraConfig, TrainConfig};
use trainq_queue::db::groups::{submit_groups, NewGroup};
use trainq_queue::db::models::{create_model, NewModel};
use trainq_queue::storage::StoreOptions;
use trainq_queue::GroupId;

use crate::common::s3::MotoServer;

/// Builds the demo's tiny model into `dir/model` and returns that directory.
pub fn build_model(dir: &Path) -> PathBuf {
    let model_dir = dir.join("model");
    trainq::demo::run::build_tiny_model(&model_dir, 7).expect("tiny model");
    model_dir
}

/// A LoRA config for the tiny model: `groups_per_step` groups a step, `lease_seconds` leases,
/// a short batch after 2 s of waiting, and trajectories without sampler log-probs accepted (the
/// fixtures' chats carry none).
pub fn tiny_config(groups_per_step: usize, lease_seconds: i64) -> TrainConfig {
    let mut cfg = TrainConfig {
        lora: Some(LoraConfig { rank: 4, alpha: 8.0, ..LoraConfig::default() }),
        max_seq_len: 64,
        max_tokens_per_micro_batch: 1024,
        ..TrainConfig::default()
    };
    cfg.optimizer.learning_rate = 1e-3;
    cfg.queue.groups_per_step = groups_per_step;
    cfg.queue.lease_seconds = lease_seconds;
    cfg.queue.max_batch_wait_seconds = 2.0;
    cfg.loss.allow_training_without_logprobs = true;
    cfg
}

/// Registers model `name` on the tiny model in `model_dir` with `cfg`.
pub async fn register(pool: &PgPool, name: &str, model_dir: &Path, cfg: TrainConfig) {
    let model = NewModel { config: cfg, ..NewModel::new(name, model_dir.display().to_string()) };
    create_model(pool, &model).await.expect("create model");
}

/// A group of one-turn chats (lowercase, so every character is in the demo vocabulary), one
/// trajectory per reward.
pub fn group_of(rewards: &[f64]) -> Value {
    let trajectories = rewards
        .iter()
        .enumerate()
        .map(|(i, r)| {
            json!({"messages": [
                {"role": "user", "content": "count to three"},
                {"role": "assistant", "content": format!("one two {i}")}
            ], "reward": r})
        })
        .collect();
    Value::Array(trajectories)
}

/// Submits one group per entry of `rewards`, all sampled from `policy_version`, in one transaction.
pub async fn submit(pool: &PgPool, model: &str, rewards: &[&[f64]], policy_version: Option<i64>) -> Vec<GroupId> {
    let groups: Vec<NewGroup> = rewards
        .iter()
        .map(|r| NewGroup {
            model: model.into(),
            trajectories: group_of(r),
            policy_version: policy_version.map(trainq_queue::StepNumber),
            metadata: json!({}),
        })
        .collect();
    submit_groups(pool, &groups).await.expect("submit groups")
}

/// One group's outcome as stored.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct GroupRow {
    /// Group id.
    pub id: GroupId,
    /// pending / claimed / trained / skipped / failed.
    pub state: String,
    /// Skip reason, when skipped.
    pub skip_reason: Option<String>,
    /// Std recorded with the skip.
    pub skip_std: Option<f64>,
    /// Step that trained it.
    pub step: Option<i64>,
    /// Claims that ended without a result.
    pub attempts: i32,
}

/// Every group of `model`, in submission order.
pub async fn groups(pool: &PgPool, model: &str) -> Vec<GroupRow> {
    sqlx::query_as(
        "SELECT id, state::text AS state, skip_reason::text AS skip_reason, skip_std, step, attempts \
         FROM trainq.groups WHERE model = $1 ORDER BY id",
    )
    .bind(model)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Number of rows in trainq.steps for `model`.
pub async fn step_rows(pool: &PgPool, model: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM trainq.steps WHERE model = $1").bind(model).fetch_one(pool).await.unwrap()
}

/// Worker options on the CPU with a fast poll, work directory `work_dir`.
pub fn options(model: &str, store_url: &str, store_options: StoreOptions, work_dir: &Path) -> WorkerOptions {
    let mut opts = WorkerOptions::new(model, store_url, trainq::worker::Placement::One(Device::Cpu));
    opts.store_options = store_options;
    opts.work_dir = work_dir.to_path_buf();
    opts.poll_interval = Duration::from_millis(100);
    opts.upload_retry_pause = Duration::from_millis(200);
    opts
}

/// Polls `condition` every 50 ms until it holds; panics with `what` after `limit`.
pub async fn wait_until<F, Fut>(what: &str, limit: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !condition().await {
        assert!(Instant::now() < deadline, "timed out after {limit:?} waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The real `trainq worker` binary, its stderr read line by line on a thread.
pub struct WorkerProcess {
    child: Child,
    lines: mpsc::Receiver<String>,
    /// Every stderr line read so far.
    pub seen: Vec<String>,
}

impl WorkerProcess {
    /// Starts `trainq worker` on the CPU for `model` with `args` and `env` (plus S3 credentials
    /// for `server` when given).
    pub fn spawn(
        database_url: &str,
        model: &str,
        store_url: &str,
        server: Option<&MotoServer>,
        work_dir: &Path,
        env: &[(&str, &str)],
        args: &[&str],
    ) -> WorkerProcess {
        let mut command = Command::new(env!("CARGO_BIN_EXE_trainq"));
        command
            .args(["worker", "--model", model, "--store", store_url, "--device", "cpu"])
            .arg("--work-dir")
            .arg(work_dir)
            .args(args)
            .env("DATABASE_URL", database_url)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .env_remove("TRAINQ_FAULT_PAUSE_AT")
            .env_remove("TRAINQ_FAULT_RESUME_FILE")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(server) = server {
            command.envs(s3_env(server));
        }
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command.spawn().expect("spawn trainq worker");
        let lines = read_lines(child.stderr.take().unwrap());
        WorkerProcess { child, lines, seen: Vec::new() }
    }

    /// Waits until a stderr line contains `needle` (and returns it); panics after `limit` or if
    /// the process ends first.
    pub fn wait_for_line(&mut self, needle: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(_) => {
                    panic!("no line containing {needle:?} within {limit:?}; stderr so far:\n{}", self.seen.join("\n"))
                }
            }
        }
    }

    /// SIGKILL, then reap.
    pub fn kill9(&mut self) {
        self.child.kill().expect("kill -9 the worker");
        self.child.wait().unwrap();
    }

    /// Waits for the process to exit (within `limit`) and returns whether it succeeded; the rest
    /// of stderr lands in `seen`.
    pub fn wait_exit(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            while let Ok(line) = self.lines.try_recv() {
                self.seen.push(line);
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                while let Ok(line) = self.lines.recv_timeout(Duration::from_millis(200)) {
                    self.seen.push(line);
                }
                return status.success();
            }
            assert!(Instant::now() < deadline, "worker still running after {limit:?}:\n{}", self.seen.join("\n"));
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The environment that points a `trainq` process's S3 client at `server`.
pub fn s3_env(server: &MotoServer) -> Vec<(&'static str, String)> {
    vec![
        ("AWS_ENDPOINT_URL", server.endpoint()),
        ("AWS_ALLOW_HTTP", "true".into()),
        ("AWS_ACCESS_KEY_ID", "test".into()),
        ("AWS_SECRET_ACCESS_KEY", "test".into()),
        ("AWS_REGION", "us-east-1".into()),
    ]
}

fn read_lines(stderr: ChildStderr) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}
