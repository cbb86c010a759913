//! `trainq checkpoint fetch` end to end: a real PEFT adapter uploaded to a real S3 server comes
//! back as a directory that peft loads as is; steps, `latest` and refusals behave as documented.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::s3::{MotoServer, BUCKET};
use trainq_queue::storage::{upload_checkpoint, CheckpointFormat, Store, UploadOptions};

fn no_progress(_: u64) {}

async fn upload(store: &Store, step: u64, dir: &Path) {
    let options = UploadOptions::default();
    upload_checkpoint(
        store,
        "m",
        trainq_queue::StepNumber(step as i64),
        CheckpointFormat::PeftLora,
        dir,
        &options,
        &no_progress,
    )
    .await
    .unwrap();
}

/// Runs `trainq checkpoint fetch ARGS` with `env` added to the child's environment only.
fn trainq_fetch(args: &[&str], env: &[(&str, String)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_trainq"));
    command.args(["checkpoint", "fetch"]).args(args).env_remove("TRAINQ_STORE").env_remove("DATABASE_URL");
    for (key, value) in env {
        command.env(key, value);
    }
    command.output().unwrap()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn python(args: &[&str]) -> String {
    let python = std::env::var("TRAINQ_PYTHON").expect("TRAINQ_PYTHON (source ~/.cache/trainq/env.sh)");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/peft_adapter.py");
    let output = Command::new(python).arg(script).args(args).output().unwrap();
    assert!(output.status.success(), "peft_adapter.py {args:?}: {}", stderr(&output));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetching_the_latest_checkpoint_from_s3_gives_a_directory_peft_loads_as_is() {
    let server = MotoServer::start();
    let store = server.store("cli");
    let work = tempfile::tempdir().unwrap();
    let root = work.path().to_str().unwrap();
    python(&["make", root]);
    let (adapter, older) = (work.path().join("adapter"), work.path().join("older"));
    std::fs::remove_file(adapter.join("README.md")).unwrap();
    common::checkpoint_files::write_checkpoint_dir(&older, &[("adapter_model.safetensors", 64)], 1);
    upload(&store, 1, &older).await;
    upload(&store, 2, &adapter).await;

    let env = server.aws_env();
    let to = work.path().join("fetched");
    let url = format!("s3://{BUCKET}/cli");
    let output = trainq_fetch(&["m", "--store", &url, "--to", to.to_str().unwrap()], &env);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(String::from_utf8_lossy(&output.stdout).contains("fetched m step 2"));
    let files = [("adapter_config.json", 0), ("adapter_model.safetensors", 0)];
    common::checkpoint_files::assert_same_files(&adapter, &to, &files);
    let base = work.path().join("base");
    let loaded = python(&["load", base.to_str().unwrap(), adapter.to_str().unwrap(), to.to_str().unwrap()]);
    assert_eq!(loaded.trim(), "ok");
}

#[tokio::test]
async fn fetching_by_step_refuses_missing_steps_models_and_occupied_destinations() {
    let work = tempfile::tempdir().unwrap();
    let url = format!("file://{}/store", work.path().display());
    let store = Store::open(&url).unwrap();
    let local = work.path().join("ckpt");
    let files = [("adapter_model.safetensors", 1000), ("adapter_config.json", 10)];
    common::checkpoint_files::write_checkpoint_dir(&local, &files, 5);
    upload(&store, 7, &local).await;
    let to = work.path().join("out");
    let to = to.to_str().unwrap();

    let fetched = trainq_fetch(&["--model", "m", "--store", &url, "--step", "7", "--to", to], &[]);
    assert!(fetched.status.success(), "{}", stderr(&fetched));
    common::checkpoint_files::assert_same_files(&local, Path::new(to), &files);

    let occupied = trainq_fetch(&["m", "--store", &url, "--to", to], &[]);
    assert!(!occupied.status.success());
    assert!(stderr(&occupied).contains("not empty"), "{}", stderr(&occupied));
    let forced = trainq_fetch(&["m", "--store", &url, "--to", to, "--force"], &[]);
    assert!(forced.status.success(), "{}", stderr(&forced));

    let missing_step = trainq_fetch(&["m", "--store", &url, "--step", "8", "--to", "/tmp/x"], &[]);
    assert!(!missing_step.status.success());
    assert!(stderr(&missing_step).contains("m/checkpoints/000008/manifest.json"), "{}", stderr(&missing_step));
    let missing_model = trainq_fetch(&["nope", "--store", &url, "--to", "/tmp/x"], &[]);
    assert!(stderr(&missing_model).contains("no complete checkpoint of model \"nope\""));
    let bad_step = trainq_fetch(&["m", "--store", &url, "--step", "last", "--to", "/tmp/x"], &[]);
    assert!(stderr(&bad_step).contains("neither a number nor `latest`"), "{}", stderr(&bad_step));
}
