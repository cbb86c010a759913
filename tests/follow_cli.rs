//! `trainq follow` end to end against real PostgreSQL and a real S3-compatible server (moto):
//! each new committed checkpoint is fetched into DIR/{step:06}, DIR/current is swapped onto it,
//! a vLLM-shaped HTTP server is told (load the new adapter, unload the previous one), the hook
//! runs, the last K stay; a forged notification (naming the next step and an attacker's complete
//! checkpoint) is never fetched; a database outage and a store restart only delay it; and
//! `trainq checkpoint fetch` refuses a checkpoint rewritten in the store after its commit.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use chrono::Utc;
use common::db::{insert_groups, TestDb};
use common::s3::MotoServer;
use common::tcp_proxy::TcpProxy;
use futures::TryStreamExt;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use trainq_queue::db::{self, CheckpointRecord, ClaimParams, StepRecord};
use trainq_queue::storage::{upload_checkpoint, CheckpointFormat, Store, UploadOptions, UploadedCheckpoint};
use trainq_queue::StepNumber;

const MODEL: &str = "m";
const DEADLINE: Duration = Duration::from_secs(90);

/// Polls `condition` every 50 ms until it holds; panics with `what` after [`DEADLINE`].
async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let start = Instant::now();
    while !condition() {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Uploads a small PEFT-shaped checkpoint for `step` (content seeded by the step).
async fn upload(store: &Store, work: &Path, step: i64) -> UploadedCheckpoint {
    upload_seeded(store, &work.join(format!("local-{step}")), step, step as u64).await
}

/// Uploads a small PEFT-shaped checkpoint for `step` from `local`, its content seeded by `seed`.
async fn upload_seeded(store: &Store, local: &Path, step: i64, seed: u64) -> UploadedCheckpoint {
    let files = [("adapter_model.safetensors", 4096 + step as usize), ("adapter_config.json", 100)];
    common::checkpoint_files::write_checkpoint_dir(local, &files, seed);
    let (options, no_progress) = (UploadOptions::default(), |_: u64| {});
    upload_checkpoint(store, MODEL, StepNumber(step), CheckpointFormat::PeftLora, local, &options, &no_progress)
        .await
        .unwrap()
}

/// Commits step `step` of [`MODEL`] with `uploaded` as its checkpoint, the way a worker does.
async fn commit(db: &TestDb, step: i64, uploaded: &UploadedCheckpoint) {
    insert_groups(&db.pool, MODEL, 1).await;
    let params = ClaimParams {
        model: MODEL.into(),
        worker_id: "w".into(),
        limit: 1,
        lease_seconds: 60.0,
        now: None,
        window: None,
    };
    let claim = db::claim_groups(&db.pool, &params).await.unwrap();
    let ids: Vec<_> = claim.groups.iter().map(|g| g.id).collect();
    let record = StepRecord {
        model: MODEL.into(),
        step: StepNumber(step),
        worker_id: "w".into(),
        async_weight_syncing: false,
        started_at: Utc::now(),
        finished_at: Utc::now(),
        groups_claimed: 1,
        groups_trained: 1,
        groups_skipped: json!({}),
        trajectories: 2,
        tokens: 10,
        loss: Some(0.1),
        loss_parts: json!({}),
        grad_norm: Some(1.0),
        learning_rate: Some(1e-5),
        reward_mean: Some(0.5),
        reward_std_mean: Some(0.5),
        policy_lag_min: Some(0),
        policy_lag_max: Some(0),
        timings: json!({}),
        devices: json!(["cpu"]),
        checkpoint_uri: Some(uploaded.uri.clone()),
        checkpoint_sha256: Some(uploaded.manifest_sha256.clone()),
        groups_wanted: None,
        reward_mean_claimed: None,
        reward_mean_skipped: None,
        logprob_coverage: None,
        importance_ratio_mean: None,
    };
    let checkpoint = CheckpointRecord {
        model: MODEL.into(),
        step: StepNumber(step),
        uri: uploaded.uri.clone(),
        format: "peft_lora".into(),
        bytes: uploaded.total_bytes as i64,
        sha256: uploaded.manifest_sha256.clone(),
        manifest: serde_json::to_value(&uploaded.manifest).unwrap(),
    };
    db::commit_step(&db.pool, &record, Some(&checkpoint), claim.token, &ids, &[]).await.unwrap();
}

/// One request a fake vLLM server received.
#[derive(Debug, Clone, PartialEq)]
struct Received {
    method: String,
    path: String,
    content_type: String,
    body: Value,
}

/// An HTTP server that records each request (one per connection) and answers 200.
async fn start_fake_vllm() -> (String, Arc<Mutex<Vec<Received>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let received: Arc<Mutex<Vec<Received>>> = Arc::default();
    let log = received.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let request = read_request(&mut socket).await;
            log.lock().unwrap().push(request);
            let answer =
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 7\r\nconnection: close\r\n\r\nSuccess";
            let _ = socket.write_all(answer.as_bytes()).await;
        }
    });
    (url, received)
}

async fn read_request(socket: &mut tokio::net::TcpStream) -> Received {
    let mut buffer = Vec::new();
    let head_end = loop {
        let mut chunk = [0u8; 4096];
        let n = socket.read(&mut chunk).await.unwrap();
        assert!(n > 0, "connection closed mid-request");
        buffer.extend_from_slice(&chunk[..n]);
        if let Some(at) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
    };
    let head = String::from_utf8_lossy(&buffer[..head_end]).to_string();
    let header = |name: &str| {
        head.lines()
            .find_map(|l| {
                l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_default()
    };
    let length: usize = header("content-length").parse().unwrap_or(0);
    while buffer.len() < head_end + length {
        let mut chunk = [0u8; 4096];
        let n = socket.read(&mut chunk).await.unwrap();
        assert!(n > 0, "connection closed mid-body");
        buffer.extend_from_slice(&chunk[..n]);
    }
    let mut first = head.lines().next().unwrap().split(' ');
    Received {
        method: first.next().unwrap().to_string(),
        path: first.next().unwrap().to_string(),
        content_type: header("content-type"),
        body: serde_json::from_slice(&buffer[head_end..head_end + length]).unwrap(),
    }
}

/// The `trainq follow` child process, its stderr collected, killed when dropped.
struct Follower {
    child: Child,
    stderr: Arc<Mutex<String>>,
}

impl Follower {
    fn start(args: &[&str], env: &[(&str, String)]) -> Follower {
        let mut command = Command::new(env!("CARGO_BIN_EXE_trainq"));
        command.arg("follow").args(args).env("RUST_LOG", "info").env_remove("TRAINQ_STORE");
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        let stderr: Arc<Mutex<String>> = Arc::default();
        let (pipe, sink) = (child.stderr.take().unwrap(), stderr.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                let mut all = sink.lock().unwrap();
                all.push_str(&line);
                all.push('\n');
            }
        });
        Follower { child, stderr }
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    fn count(&self, needle: &str) -> usize {
        self.stderr().matches(needle).count()
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn current(dir: &Path) -> Option<String> {
    std::fs::read_link(dir.join("current")).ok().map(|p| p.to_string_lossy().into_owned())
}

fn step_dirs(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().unwrap().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn load(name: &str, path: &Path) -> Received {
    Received {
        method: "POST".into(),
        path: "/v1/load_lora_adapter".into(),
        content_type: "application/json".into(),
        body: json!({"lora_name": name, "lora_path": path.to_str().unwrap()}),
    }
}

fn unload(name: &str) -> Received {
    Received {
        method: "POST".into(),
        path: "/v1/unload_lora_adapter".into(),
        content_type: "application/json".into(),
        body: json!({"lora_name": name}),
    }
}

/// Every object of checkpoint `step`, to put back after the store lost them.
async fn snapshot(store: &Store, step: i64) -> Vec<(object_store::path::Path, Bytes)> {
    let prefix = store.checkpoint_dir(MODEL, StepNumber(step));
    let metas: Vec<_> = store.object_store().list(Some(&prefix)).try_collect().await.unwrap();
    let mut objects = Vec::new();
    for meta in metas {
        let bytes = store.object_store().get(&meta.location).await.unwrap().bytes().await.unwrap();
        objects.push((meta.location, bytes));
    }
    assert!(objects.len() >= 3, "{objects:?}");
    objects
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn follow_fetches_swaps_and_announces_each_checkpoint_and_rides_out_outages() {
    let db = TestDb::new().await;
    db.create_model(MODEL).await;
    let mut s3 = MotoServer::start();
    let store = s3.store("follow");
    let work = tempfile::tempdir().unwrap();
    let dir: PathBuf = std::path::absolute(work.path().join("weights")).unwrap();
    let hook_log = work.path().join("hook.log");
    let (vllm_url, vllm) = start_fake_vllm().await;
    let database = url::Url::parse(&db.url(None)).unwrap();
    let upstream = format!("{}:{}", database.host_str().unwrap(), database.port().unwrap_or(5432));
    let proxy = TcpProxy::start(upstream).await;
    let mut via_proxy = database.clone();
    via_proxy.set_host(Some("127.0.0.1")).unwrap();
    via_proxy.set_port(Some(proxy.addr.port())).unwrap();

    let first = upload(&store, work.path(), 1).await;
    commit(&db, 1, &first).await;
    let mut env = s3.aws_env();
    env.push(("DATABASE_URL", via_proxy.to_string()));
    let hook = format!(
        "echo \"$TRAINQ_MODEL $TRAINQ_STEP $TRAINQ_ADAPTER_NAME $TRAINQ_CHECKPOINT_DIR\" >> {}",
        hook_log.display()
    );
    let dir_arg = dir.to_str().unwrap();
    let args =
        ["--model", MODEL, "--dir", dir_arg, "--keep", "2", "--vllm", &vllm_url, "--exec", &hook, "--max-backoff", "1"];
    let follower = Follower::start(&args, &env);

    wait_until("step 1 in place and announced", || vllm.lock().unwrap().len() == 1).await;
    assert_eq!(current(&dir).as_deref(), Some("000001"));
    common::checkpoint_files::assert_same_files(
        &work.path().join("local-1"),
        &dir.join("000001"),
        &[("adapter_model.safetensors", 0), ("adapter_config.json", 0)],
    );

    // A forged notification, as any role can send: the next step, pointing at an attacker's
    // complete checkpoint. It only wakes the follower, which reads the table and finds no step 2.
    let evil = upload_seeded(&s3.store("evil"), &work.path().join("evil-2"), 2, 666).await;
    let forged = json!({"model": MODEL, "step": 2, "uri": evil.uri, "sha256": evil.manifest_sha256});
    sqlx::query("SELECT pg_notify('trainq_checkpoints', $1)").bind(forged.to_string()).execute(&db.pool).await.unwrap();
    sqlx::query("SELECT pg_notify('trainq_checkpoints', '{\"model\": \"m\", \"step\": 99, \"uri\": \"s3://evil/\"}')")
        .execute(&db.pool)
        .await
        .unwrap();
    for step in [2, 3] {
        let uploaded = upload(&store, work.path(), step).await;
        commit(&db, step, &uploaded).await;
        let name = format!("{step:06}");
        wait_until(&format!("current → {name}"), || current(&dir).as_deref() == Some(name.as_str())).await;
        // The committed bytes, never the attacker's.
        common::checkpoint_files::assert_same_files(
            &work.path().join(format!("local-{step}")),
            &dir.join(&name),
            &[("adapter_model.safetensors", 0), ("adapter_config.json", 0)],
        );
    }
    wait_until("five vLLM requests", || vllm.lock().unwrap().len() == 5).await;
    let step_path = |step: i64| dir.join(format!("{step:06}"));
    assert_eq!(
        *vllm.lock().unwrap(),
        vec![
            load("m-step-000001", &step_path(1)),
            load("m-step-000002", &step_path(2)),
            unload("m-step-000001"),
            load("m-step-000003", &step_path(3)),
            unload("m-step-000002"),
        ]
    );
    // Pruning follows the swap: wait for it rather than race it.
    wait_until("--keep 2 leaves 000002 and 000003", || step_dirs(&dir) == ["000002", "000003"]).await;
    let hooks = std::fs::read_to_string(&hook_log).unwrap();
    let expected: Vec<String> = (1..=3).map(|s| format!("m {s} m-step-{s:06} {}", step_path(s).display())).collect();
    assert_eq!(hooks.lines().collect::<Vec<_>>(), expected);

    // The database goes away: the follower retries, and picks up the step committed meanwhile.
    let retries = follower.count("retrying in");
    proxy.cut();
    wait_until("a retry during the database outage", || follower.count("retrying in") > retries).await;
    let fourth = upload(&store, work.path(), 4).await;
    commit(&db, 4, &fourth).await;
    proxy.restore();
    wait_until("current → 000004 after the outage", || current(&dir).as_deref() == Some("000004")).await;

    // The store restarts empty: the committed step 5 is unreadable until its objects are back.
    let fifth = upload(&store, work.path(), 5).await;
    let objects = snapshot(&store, 5).await;
    s3.restart();
    commit(&db, 5, &fifth).await;
    wait_until("a failed fetch of step 5", || follower.stderr().contains("step 5 of model \"m\" is not a complete"))
        .await;
    for (key, bytes) in objects {
        store.object_store().put(&key, PutPayload::from(bytes)).await.unwrap();
    }
    wait_until("current → 000005 after the store came back", || current(&dir).as_deref() == Some("000005")).await;
    wait_until("--keep 2 leaves 000004 and 000005", || step_dirs(&dir) == ["000004", "000005"]).await;
    assert!(!follower.stderr().contains("000099"), "{}", follower.stderr());
    assert!(!follower.stderr().contains("evil"), "{}", follower.stderr());
    assert!(vllm.lock().unwrap().iter().all(|r| !r.body.to_string().contains("99")));
    assert_eq!(vllm.lock().unwrap().last(), Some(&unload("m-step-000004")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_fetch_refuses_a_checkpoint_rewritten_in_the_store_after_its_commit() {
    let db = TestDb::new().await;
    db.create_model(MODEL).await;
    let s3 = MotoServer::start();
    let store = s3.store("fetch");
    let work = tempfile::tempdir().unwrap();
    let genuine = upload(&store, work.path(), 1).await;
    commit(&db, 1, &genuine).await;
    let fetch = |to: &Path| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_trainq"));
        command.args(["checkpoint", "fetch", MODEL, "--to"]).arg(to).env("DATABASE_URL", db.url(None));
        command.env_remove("TRAINQ_STORE").envs(s3.aws_env()).output().unwrap()
    };
    let out = fetch(&work.path().join("ok"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Someone with write access to the store replaces step 1, manifest and all: self-consistent,
    // but not what was committed.
    let rewritten = upload_seeded(&store, &work.path().join("rewritten"), 1, 666).await;
    assert_ne!(rewritten.manifest_sha256, genuine.manifest_sha256);
    let to = work.path().join("refused");
    let out = fetch(&to);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains(&format!("differs from the committed {}", genuine.manifest_sha256)), "{stderr}");
    assert!(!to.join("adapter_model.safetensors").exists(), "nothing is fetched");
}
