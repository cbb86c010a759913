//! Checkpoint upload against a real S3 server (moto) that misbehaves: large files go multipart,
//! a server that stays away fails the upload cleanly with no manifest, and a server restarted
//! on the same port within the retry window does not fail it.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::checkpoint_files::{assert_same_files, peft_layout, write_checkpoint_dir};
use common::s3::MotoServer;
use object_store::ObjectStoreExt;
use tokio::sync::Notify;
use trainq_queue::storage::{
    fetch_checkpoint, latest_complete_step, list_checkpoints, upload_checkpoint, CheckpointFormat, FetchOptions,
    FileRetry, Store, UploadOptions, UploadedCheckpoint,
};
use trainq_queue::{Error, Result, StepNumber};

const MIB: usize = 1024 * 1024;

fn no_progress(_: u64) {}

/// A checkpoint with a 30 MiB adapter being uploaded (step 1 of model `m`) on a task of its own,
/// in sequential 5 MiB parts so that it is still uploading when the server misbehaves.
struct SlowUpload {
    _work: tempfile::TempDir,
    local: PathBuf,
    files: Vec<(&'static str, usize)>,
    task: tokio::task::JoinHandle<Result<UploadedCheckpoint>>,
}

/// Writes the checkpoint, starts its upload, and returns once the first bytes went to the store.
async fn start_slow_upload(store: Store, seed: u64, retry: FileRetry) -> SlowUpload {
    let work = tempfile::tempdir().unwrap();
    let local = work.path().join("ckpt");
    let files = peft_layout(30 * MIB);
    write_checkpoint_dir(&local, &files, seed);
    let started = Arc::new(Notify::new());
    let (dir, notify) = (local.clone(), started.clone());
    let task = tokio::spawn(async move {
        let progress = move |_: u64| notify.notify_one();
        let options = slow_options(retry);
        upload_checkpoint(&store, "m", StepNumber(1), CheckpointFormat::PeftLora, &dir, &options, &progress).await
    });
    started.notified().await;
    SlowUpload { _work: work, local, files, task }
}

/// Sequential 5 MiB parts.
fn slow_options(retry: FileRetry) -> UploadOptions {
    UploadOptions {
        multipart_threshold: 5 * MIB as u64,
        part_size: 5 * MIB,
        parts_in_flight: 1,
        retry,
        ..UploadOptions::default()
    }
}

async fn assert_fetches_identically(store: &Store, local: &std::path::Path, files: &[(&str, usize)]) {
    let to = local.with_file_name("fetched");
    fetch_checkpoint(store, "m", StepNumber(1), &to, &FetchOptions::default(), &no_progress).await.unwrap();
    assert_same_files(local, &to, files);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_over_twenty_mib_goes_multipart_and_fetches_byte_identical() {
    let server = MotoServer::start();
    let store = server.store("big");
    let work = tempfile::tempdir().unwrap();
    let local = work.path().join("ckpt");
    let files = peft_layout(21 * MIB + 3);
    write_checkpoint_dir(&local, &files, 11);

    let options = UploadOptions::default();
    upload_checkpoint(&store, "m", StepNumber(1), CheckpointFormat::PeftLora, &local, &options, &no_progress)
        .await
        .unwrap();
    let key = store.checkpoint_file("m", StepNumber(1), "adapter_model.safetensors");
    let meta = store.object_store().head(&key).await.unwrap();
    let e_tag = meta.e_tag.unwrap_or_default();
    assert!(e_tag.trim_matches('"').ends_with("-2"), "two 16 MiB-max parts expected, e_tag {e_tag}");
    let small = store.checkpoint_file("m", StepNumber(1), "adapter_config.json");
    let small_tag = store.object_store().head(&small).await.unwrap().e_tag.unwrap_or_default();
    assert!(!small_tag.contains('-'), "small files are single puts, e_tag {small_tag}");
    assert_fetches_identically(&store, &local, &files).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_to_a_server_that_stays_away_fails_clearly_without_manifest_and_a_retry_succeeds() {
    let server = MotoServer::start();
    let impatient = Store::open_with(&server.url("away"), &server.store_options(Duration::from_secs(1))).unwrap();
    let retry = FileRetry { attempts: 2, first_backoff: Duration::from_millis(10) };
    let upload = start_slow_upload(impatient, 12, retry).await;
    server.pause();
    let began = Instant::now();
    let error = upload.task.await.unwrap().unwrap_err();
    server.resume();

    let message = error.to_string();
    assert!(matches!(error, Error::Store { .. }), "{message}");
    assert!(message.contains("away/m/checkpoints/000001/"), "the error names the object: {message}");
    assert!(began.elapsed() < Duration::from_secs(60), "gave up after {:?}", began.elapsed());
    let store = server.store("away");
    let listed = list_checkpoints(&store, "m").await.unwrap();
    assert!(listed.iter().all(|c| !c.has_manifest), "no manifest after a failed upload: {listed:?}");
    assert_eq!(latest_complete_step(&store, "m").await.unwrap(), None);

    let options = slow_options(FileRetry::default());
    upload_checkpoint(&store, "m", StepNumber(1), CheckpointFormat::PeftLora, &upload.local, &options, &no_progress)
        .await
        .unwrap();
    assert_eq!(latest_complete_step(&store, "m").await.unwrap(), Some(StepNumber(1)));
    assert_fetches_identically(&store, &upload.local, &upload.files).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_survives_the_server_restarting_on_the_same_port_within_the_retry_window() {
    let mut server = MotoServer::start();
    let store = server.store("restart");
    let retry = FileRetry { attempts: 6, first_backoff: Duration::from_millis(200) };
    let upload = start_slow_upload(store.clone(), 13, retry).await;
    let port = server.port;
    tokio::task::block_in_place(|| server.restart());
    assert_eq!(server.port, port);

    let uploaded = upload.task.await.unwrap().expect("the upload rides out the restart");
    assert_eq!(uploaded.manifest.files.len(), upload.files.len());
    // moto forgets everything on restart, so this fetch succeeds only if the upload spanned the
    // restart and put every file (small ones finished earlier included) into the new server.
    assert_fetches_identically(&store, &upload.local, &upload.files).await;
}
