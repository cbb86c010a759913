//! One storage test body run against every backend: memory://, file:// and a real S3 server
//! (moto). Upload → manifest → fetch byte-identical → latest step → corrupted object refused →
//! retention.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::checkpoint_files::{assert_same_files, peft_layout, write_checkpoint_dir};
use common::s3::MotoServer;
use object_store::{ObjectStoreExt, PutPayload};
use trainq_queue::storage::manifest::sha256_hex;
use trainq_queue::storage::{
    apply_retention, complete_steps, fetch_checkpoint, latest_complete_step, read_manifest, upload_checkpoint,
    CheckpointFormat, FetchOptions, FileRetry, RetentionPolicy, Store, UploadOptions,
};
use trainq_queue::{Error, StepNumber};

/// Small parts so that every backend runs the multipart path on a 12 MiB adapter.
fn small_part_options() -> UploadOptions {
    UploadOptions {
        multipart_threshold: 5 * 1024 * 1024,
        part_size: 5 * 1024 * 1024,
        retry: FileRetry { attempts: 2, first_backoff: Duration::from_millis(10) },
        ..UploadOptions::default()
    }
}

fn no_progress(_: u64) {}

async fn round_trip_body(store: Store) {
    let work = tempfile::tempdir().unwrap();
    let (local, fetched) = (work.path().join("ckpt"), work.path().join("out/step"));
    let files = peft_layout(12 * 1024 * 1024 + 17);
    write_checkpoint_dir(&local, &files, 7);

    let uploaded = upload_checkpoint(
        &store,
        "m1",
        StepNumber(3),
        CheckpointFormat::PeftLora,
        &local,
        &small_part_options(),
        &no_progress,
    )
    .await
    .unwrap();
    let expected_total: usize = files.iter().map(|f| f.1).sum();
    assert_eq!(uploaded.total_bytes, expected_total as u64);
    assert_eq!(uploaded.uri, format!("{}/m1/checkpoints/000003/", store.url()));

    let manifest_key = store.checkpoint_file("m1", StepNumber(3), "manifest.json");
    let manifest_bytes = store.object_store().get(&manifest_key).await.unwrap().bytes().await.unwrap();
    assert_eq!(sha256_hex(&manifest_bytes), uploaded.manifest_sha256);
    let manifest = read_manifest(&store, "m1", StepNumber(3)).await.unwrap();
    assert_eq!(manifest.format, CheckpointFormat::PeftLora);
    assert_eq!(manifest.files.len(), files.len());
    for entry in &manifest.files {
        let content = std::fs::read(local.join(&entry.path)).unwrap();
        assert_eq!(entry.bytes, content.len() as u64, "{}", entry.path);
        assert_eq!(entry.sha256, sha256_hex(&content), "{}", entry.path);
    }

    let (seen, count) = byte_counter();
    fetch_checkpoint(&store, "m1", StepNumber(3), &fetched, &FetchOptions::default(), &count).await.unwrap();
    assert_same_files(&local, &fetched, &files);
    assert_eq!(seen.load(std::sync::atomic::Ordering::Relaxed), expected_total as u64);
    assert_eq!(latest_complete_step(&store, "m1").await.unwrap(), Some(StepNumber(3)));
    assert_eq!(latest_complete_step(&store, "other").await.unwrap(), None);

    corrupted_object_is_refused(&store, &work.path().join("corrupt")).await;
    retention_deletes_the_right_steps(&store, &local).await;
}

/// Overwrites the adapter config with same-sized other bytes: fetch must name the file.
async fn corrupted_object_is_refused(store: &Store, to_dir: &std::path::Path) {
    let key = store.checkpoint_file("m1", StepNumber(3), "adapter_config.json");
    store.object_store().put(&key, PutPayload::from(vec![b'x'; 700])).await.unwrap();
    let options = FetchOptions { retry: FileRetry { attempts: 1, ..FileRetry::default() }, ..FetchOptions::default() };
    let error = fetch_checkpoint(store, "m1", StepNumber(3), to_dir, &options, &no_progress).await.unwrap_err();
    let message = error.to_string();
    assert!(matches!(error, Error::Checkpoint { .. }), "{message}");
    assert!(message.contains("adapter_config.json") && message.contains("sha256 mismatch"), "{message}");
    assert!(!to_dir.exists(), "a refused fetch must leave no destination");
    let leftovers = std::fs::read_dir(to_dir.parent().unwrap()).unwrap().count();
    assert_eq!(leftovers, 2, "only ckpt/ and out/ remain next to the destination");
}

async fn retention_deletes_the_right_steps(store: &Store, local: &std::path::Path) {
    let tiny = [("adapter_model.safetensors", 100), ("adapter_config.json", 10)];
    let tiny_dir = local.with_file_name("tiny");
    write_checkpoint_dir(&tiny_dir, &tiny, 1);
    for step in 1..=6 {
        let options = UploadOptions::default();
        upload_checkpoint(store, "m2", StepNumber(step), CheckpointFormat::PeftLora, &tiny_dir, &options, &no_progress)
            .await
            .unwrap();
    }
    // An old failed upload left a partial checkpoint (step 0, no manifest) behind.
    let partial = store.checkpoint_file("m2", StepNumber(0), "adapter_model.safetensors");
    store.object_store().put(&partial, PutPayload::from(vec![1u8; 10])).await.unwrap();

    let policy = RetentionPolicy { keep_last: 2, keep_every: 3 };
    let deleted = apply_retention(store, "m2", &policy).await.unwrap();
    assert_eq!(deleted, vec![StepNumber(0), StepNumber(1), StepNumber(2), StepNumber(4)]);
    assert_eq!(complete_steps(store, "m2").await.unwrap(), vec![StepNumber(3), StepNumber(5), StepNumber(6)]);
    let listed = trainq_queue::storage::list_checkpoints(store, "m2").await.unwrap();
    assert_eq!(
        listed.iter().map(|c| c.step).collect::<Vec<_>>(),
        vec![StepNumber(3), StepNumber(5), StepNumber(6)],
        "no object left"
    );
    assert_eq!(complete_steps(store, "m1").await.unwrap(), vec![StepNumber(3)], "other models untouched");
}

fn byte_counter() -> (Arc<std::sync::atomic::AtomicU64>, impl Fn(u64) + Send + Sync) {
    let counter = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let shared = counter.clone();
    (counter, move |n| {
        shared.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    })
}

#[tokio::test]
async fn memory_store_round_trips_verifies_and_retains_checkpoints() {
    round_trip_body(Store::open("memory://").unwrap()).await;
}

#[tokio::test]
async fn file_store_round_trips_verifies_and_retains_checkpoints() {
    let root = tempfile::tempdir().unwrap();
    let url = format!("file://{}/store", root.path().display());
    round_trip_body(Store::open(&url).unwrap()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_store_round_trips_verifies_and_retains_checkpoints() {
    let server = MotoServer::start();
    round_trip_body(server.store("runs/exp1")).await;
}
