//! Uploading a local checkpoint directory: large files through parallel multipart uploads,
//! small ones with one put, sha256 computed while reading, every file's presence checked, and
//! `manifest.json` written last.

use std::path::{Path as FsPath, PathBuf};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload, WriteMultipart};
use sha2::{Digest, Sha256};
use std::io::Read;
use tokio::sync::mpsc;

use super::manifest::{list_checkpoint_files, sha256_hex, CheckpointFormat, Manifest, ManifestFile};
use super::store::{Store, MANIFEST_FILE};
use super::transfer_retry::FileRetry;
use crate::error::{Error, Result};
use crate::ids::StepNumber;

/// Default for [`UploadOptions::multipart_threshold`]: 16 MiB.
pub const DEFAULT_MULTIPART_THRESHOLD: u64 = 16 * 1024 * 1024;
/// Default for [`UploadOptions::part_size`]: 16 MiB (S3 needs ≥ 5 MiB for all but the last).
pub const DEFAULT_PART_SIZE: usize = 16 * 1024 * 1024;
/// Default for [`UploadOptions::parts_in_flight`].
pub const DEFAULT_PARTS_IN_FLIGHT: usize = 8;
/// Default for [`UploadOptions::files_in_flight`].
pub const DEFAULT_FILES_IN_FLIGHT: usize = 4;

/// Called with the number of bytes just handed to the store (upload) or written (fetch).
pub type Progress<'a> = &'a (dyn Fn(u64) + Send + Sync);

/// How a checkpoint directory is uploaded.
#[derive(Debug, Clone)]
pub struct UploadOptions {
    /// Files larger than this go through a multipart upload. Default
    /// [`DEFAULT_MULTIPART_THRESHOLD`].
    pub multipart_threshold: u64,
    /// Size of each multipart part. Default [`DEFAULT_PART_SIZE`].
    pub part_size: usize,
    /// Parts of one file uploaded at once. Default [`DEFAULT_PARTS_IN_FLIGHT`].
    pub parts_in_flight: usize,
    /// Files uploaded at once. Default `DEFAULT_FILES_IN_FLIGHT`.
    pub files_in_flight: usize,
    /// Whole-file retries on top of the store's per-request retries.
    pub retry: FileRetry,
}

impl Default for UploadOptions {
    fn default() -> Self {
        UploadOptions {
            multipart_threshold: DEFAULT_MULTIPART_THRESHOLD,
            part_size: DEFAULT_PART_SIZE,
            parts_in_flight: DEFAULT_PARTS_IN_FLIGHT,
            files_in_flight: DEFAULT_FILES_IN_FLIGHT,
            retry: FileRetry::default(),
        }
    }
}

/// What the worker records in Postgres once the upload returned.
#[derive(Debug, Clone)]
pub struct UploadedCheckpoint {
    /// `{store url}/{model}/checkpoints/{step:06}/`.
    pub uri: String,
    /// Sum of the file sizes (manifest excluded).
    pub total_bytes: u64,
    /// sha256 of the uploaded `manifest.json` bytes.
    pub manifest_sha256: String,
    /// The manifest as written.
    pub manifest: Manifest,
}

/// Uploads every file under `dir` as checkpoint `step` of `model`, then `manifest.json`.
///
/// The manifest is written only after every file was uploaded and found in the store with its
/// size, so a reader that sees the manifest sees a whole checkpoint. On error nothing about the
/// checkpoint is claimed: files already uploaded stay (a later upload overwrites them).
pub async fn upload_checkpoint(
    store: &Store,
    model: &str,
    step: StepNumber,
    format: CheckpointFormat,
    dir: &FsPath,
    options: &UploadOptions,
    progress: Progress<'_>,
) -> Result<UploadedCheckpoint> {
    let names = list_checkpoint_files(dir)?;
    let upload_all = |names: Vec<String>| {
        futures::stream::iter(names)
            .map(|name| {
                let local = dir.join(&name);
                let key = store.checkpoint_file(model, step, &name);
                let what = format!("upload {model} step {step} {name}");
                let job = FileUpload { store, key, local, name, options, progress };
                async move { options.retry.run(&what, || job.run()).await }
            })
            .buffer_unordered(options.files_in_flight.max(1))
            .try_collect::<Vec<ManifestFile>>()
    };
    let mut files = upload_all(names).await?;
    let mut rounds = 0;
    loop {
        let missing = missing_files(store, model, step, &files).await?;
        if missing.is_empty() {
            break;
        }
        rounds += 1;
        if rounds > options.retry.attempts {
            let path = store.checkpoint_uri(model, step);
            let message = format!("files vanished after upload: {missing:?}");
            return Err(Error::Checkpoint { path, message });
        }
        tracing::warn!(model, %step, ?missing, "uploaded files absent from the store; uploading again");
        files.retain(|f| !missing.contains(&f.path));
        files.extend(upload_all(missing).await?);
    }
    write_manifest(store, Manifest::new(model, step, format, files), options).await
}

/// Puts `manifest.json` (with the usual retries) and returns what the worker records.
async fn write_manifest(store: &Store, manifest: Manifest, options: &UploadOptions) -> Result<UploadedCheckpoint> {
    let (model, step) = (manifest.model.as_str(), manifest.step);
    let json = Bytes::from(manifest.to_json()?);
    let key = store.checkpoint_file(model, step, MANIFEST_FILE);
    let what = format!("upload {model} step {step} {MANIFEST_FILE}");
    options
        .retry
        .run(&what, || async {
            let payload = PutPayload::from(json.clone());
            store.object_store().put(&key, payload).await.map_err(store_error("put", &key))
        })
        .await?;
    Ok(UploadedCheckpoint {
        uri: store.checkpoint_uri(model, step),
        total_bytes: manifest.total_bytes,
        manifest_sha256: sha256_hex(&json),
        manifest,
    })
}

/// The paths of `files` that are not in the store with the size uploaded.
async fn missing_files(store: &Store, model: &str, step: StepNumber, files: &[ManifestFile]) -> Result<Vec<String>> {
    let mut missing = Vec::new();
    for file in files {
        let key = store.checkpoint_file(model, step, &file.path);
        match store.object_store().head(&key).await {
            Ok(meta) if meta.size == file.bytes => {}
            Ok(_) | Err(object_store::Error::NotFound { .. }) => missing.push(file.path.clone()),
            Err(source) => return Err(Error::Store { what: "head", path: key.to_string(), source }),
        }
    }
    Ok(missing)
}

/// One file's upload attempt.
struct FileUpload<'a> {
    store: &'a Store,
    key: Path,
    local: PathBuf,
    name: String,
    options: &'a UploadOptions,
    progress: Progress<'a>,
}

impl FileUpload<'_> {
    async fn run(&self) -> Result<ManifestFile> {
        let bytes = tokio::fs::metadata(&self.local).await.map_err(Error::io(&self.local))?.len();
        let sha256 = if bytes > self.options.multipart_threshold {
            self.put_multipart().await?
        } else {
            self.put_whole().await?
        };
        Ok(ManifestFile { path: self.name.clone(), bytes, sha256 })
    }

    async fn put_whole(&self) -> Result<String> {
        let content = Bytes::from(tokio::fs::read(&self.local).await.map_err(Error::io(&self.local))?);
        let len = content.len() as u64;
        let hashed = content.clone();
        let sha256 = tokio::task::spawn_blocking(move || sha256_hex(&hashed)).await.expect("hash task");
        let payload = PutPayload::from(content);
        self.store.object_store().put(&self.key, payload).await.map_err(store_error("put", &self.key))?;
        (self.progress)(len);
        Ok(sha256)
    }

    /// Reads and hashes on a blocking thread, one part at a time, while up to
    /// `parts_in_flight` parts are being uploaded.
    async fn put_multipart(&self) -> Result<String> {
        let upload = self.store.object_store().put_multipart(&self.key).await;
        let mut writer = WriteMultipart::new_with_chunk_size(
            upload.map_err(store_error("start multipart upload", &self.key))?,
            self.options.part_size,
        );
        let (parts_tx, mut parts) = mpsc::channel::<Bytes>(2);
        let (local, part_size) = (self.local.clone(), self.options.part_size);
        let reader = tokio::task::spawn_blocking(move || read_and_hash(&local, part_size, parts_tx));
        while let Some(part) = parts.recv().await {
            if let Err(source) = writer.wait_for_capacity(self.options.parts_in_flight.max(1)).await {
                drop(parts);
                let _ = writer.abort().await;
                return Err(Error::Store { what: "upload part of", path: self.key.to_string(), source });
            }
            let len = part.len() as u64;
            writer.put(part);
            (self.progress)(len);
        }
        let sha256 = match reader.await.expect("reader task") {
            Ok(sha256) => sha256,
            Err(error) => {
                let _ = writer.abort().await;
                return Err(error);
            }
        };
        writer.finish().await.map_err(store_error("complete multipart upload", &self.key))?;
        Ok(sha256)
    }
}

/// Sends `path` in `part_size` chunks and returns its sha256; stops early when the receiver
/// is gone (the upload failed).
fn read_and_hash(path: &FsPath, part_size: usize, parts: mpsc::Sender<Bytes>) -> Result<String> {
    let mut file = std::fs::File::open(path).map_err(Error::io(path))?;
    let mut hasher = Sha256::new();
    loop {
        let mut buffer = vec![0u8; part_size];
        let mut filled = 0;
        while filled < part_size {
            let read = file.read(&mut buffer[filled..]).map_err(Error::io(path))?;
            if read == 0 {
                break;
            }
            filled += read;
        }
        if filled == 0 {
            break;
        }
        buffer.truncate(filled);
        hasher.update(&buffer);
        if parts.blocking_send(Bytes::from(buffer)).is_err() {
            break;
        }
        if filled < part_size {
            break;
        }
    }
    Ok(hex::encode(hasher.finalize()))
}

/// Maps an object_store error on `key` into the crate error.
pub(crate) fn store_error(what: &'static str, key: &Path) -> impl FnOnce(object_store::Error) -> Error {
    let path = key.to_string();
    move |source| Error::Store { what, path, source }
}
