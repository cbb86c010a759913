//! Downloading a checkpoint: read its manifest, stream every file into a temporary directory
//! next to the destination while hashing, verify sizes and sha256, then rename into place.
//! The result holds exactly the uploaded files plus `manifest.json`, so peft and vLLM load it
//! as is.

use std::path::{Path as FsPath, PathBuf};

use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use super::manifest::{Manifest, ManifestFile};
use super::store::{Store, MANIFEST_FILE};
use super::transfer_retry::FileRetry;
use super::upload::{store_error, Progress, DEFAULT_FILES_IN_FLIGHT};
use crate::error::{Error, Result};
use crate::ids::StepNumber;

/// How a checkpoint is fetched.
#[derive(Debug, Clone)]
pub struct FetchOptions {
    /// Files downloaded at once. Default `DEFAULT_FILES_IN_FLIGHT`.
    pub files_in_flight: usize,
    /// Whole-file retries (a cut stream, a checksum mismatch) on top of per-request retries.
    pub retry: FileRetry,
    /// Replace a non-empty destination directory. Default false: such a destination is an error.
    pub replace_existing: bool,
    /// The sha256 (hex) that the checkpoint's `manifest.json` must have, e.g. the one its commit
    /// recorded in `trainq.checkpoints`: a manifest rewritten in the store since is refused
    /// before any file is downloaded. Default `None`: not checked.
    pub expected_manifest_sha256: Option<String>,
}

impl Default for FetchOptions {
    fn default() -> Self {
        FetchOptions {
            files_in_flight: DEFAULT_FILES_IN_FLIGHT,
            retry: FileRetry::default(),
            replace_existing: false,
            expected_manifest_sha256: None,
        }
    }
}

/// Reads and validates the manifest of checkpoint `step` of `model`.
pub async fn read_manifest(store: &Store, model: &str, step: StepNumber) -> Result<Manifest> {
    read_manifest_checked(store, model, step, None).await
}

/// Reads the manifest and, when `expected_sha256` is given, refuses one whose bytes hash to
/// anything else.
async fn read_manifest_checked(
    store: &Store,
    model: &str,
    step: StepNumber,
    expected_sha256: Option<&str>,
) -> Result<Manifest> {
    let key = store.checkpoint_file(model, step, MANIFEST_FILE);
    let result = match store.object_store().get(&key).await {
        Err(object_store::Error::NotFound { .. }) => {
            let message =
                format!("no manifest: step {step} of model {model:?} is not a complete checkpoint in {}", store.url());
            return Err(Error::Checkpoint { path: key.to_string(), message });
        }
        other => other.map_err(store_error("get", &key))?,
    };
    let bytes = result.bytes().await.map_err(store_error("read", &key))?;
    if let Some(expected) = expected_sha256 {
        let found = super::manifest::sha256_hex(&bytes);
        if !found.eq_ignore_ascii_case(expected) {
            let message = format!("manifest sha256 {found} differs from the committed {expected}");
            return Err(Error::Checkpoint { path: key.to_string(), message });
        }
    }
    Manifest::from_json(&bytes, model, step)
}

/// Downloads checkpoint `step` of `model` into `to_dir` (created; its parent must be writable)
/// and returns its manifest. `progress` receives the bytes written as they arrive. Any
/// size or sha256 mismatch (of a file, or of the manifest against
/// [`FetchOptions::expected_manifest_sha256`]) fails the fetch with an error naming the file,
/// and leaves `to_dir` untouched.
pub async fn fetch_checkpoint(
    store: &Store,
    model: &str,
    step: StepNumber,
    to_dir: &FsPath,
    options: &FetchOptions,
    progress: Progress<'_>,
) -> Result<Manifest> {
    let expected = options.expected_manifest_sha256.as_deref();
    let manifest = read_manifest_checked(store, model, step, expected).await?;
    let staging = staging_dir(to_dir)?;
    let downloaded = download_all(store, &manifest, &staging, options, progress).await;
    let placed = match downloaded {
        Ok(()) => place(&manifest, &staging, to_dir, options.replace_existing).await,
        Err(error) => Err(error),
    };
    if placed.is_err() {
        let _ = tokio::fs::remove_dir_all(&staging).await;
    }
    placed.map(|()| manifest)
}

async fn download_all(
    store: &Store,
    manifest: &Manifest,
    staging: &FsPath,
    options: &FetchOptions,
    progress: Progress<'_>,
) -> Result<()> {
    // Futures built in a plain loop (not a closure over the stream's items), so the whole
    // fetch stays `Send` for `tokio::spawn` callers.
    let mut jobs = Vec::with_capacity(manifest.files.len());
    for file in &manifest.files {
        let what = format!("fetch {} step {} {}", manifest.model, manifest.step, file.path);
        let job = FileDownload { store, manifest, file, local: staging.join(&file.path), progress };
        jobs.push(async move { options.retry.run(&what, || job.run()).await });
    }
    futures::stream::iter(jobs).buffer_unordered(options.files_in_flight.max(1)).try_collect::<Vec<()>>().await?;
    Ok(())
}

/// Writes the manifest next to the files and renames the staging directory to `to_dir`.
async fn place(manifest: &Manifest, staging: &FsPath, to_dir: &FsPath, replace: bool) -> Result<()> {
    let manifest_path = staging.join(MANIFEST_FILE);
    tokio::fs::write(&manifest_path, manifest.to_json()?).await.map_err(Error::io(&manifest_path))?;
    let mut previous = None;
    if let Ok(mut entries) = tokio::fs::read_dir(to_dir).await {
        let empty = entries.next_entry().await.map_err(Error::io(to_dir))?.is_none();
        if empty {
            tokio::fs::remove_dir(to_dir).await.map_err(Error::io(to_dir))?;
        } else if replace {
            let old = sibling(to_dir, "old")?;
            tokio::fs::rename(to_dir, &old).await.map_err(Error::io(to_dir))?;
            previous = Some(old);
        } else {
            let message = "destination exists and is not empty (pass replace_existing / --force)";
            return Err(Error::Checkpoint { path: to_dir.display().to_string(), message: message.into() });
        }
    }
    tokio::fs::rename(staging, to_dir).await.map_err(Error::io(to_dir))?;
    if let Some(old) = previous {
        tokio::fs::remove_dir_all(&old).await.map_err(Error::io(&old))?;
    }
    Ok(())
}

/// A fresh directory next to `to_dir` (same file system, so the final rename is atomic).
fn staging_dir(to_dir: &FsPath) -> Result<PathBuf> {
    let staging = sibling(to_dir, "partial")?;
    std::fs::create_dir_all(&staging).map_err(Error::io(&staging))?;
    Ok(staging)
}

/// `{parent}/.{name}.{tag}-{random}`.
fn sibling(to_dir: &FsPath, tag: &str) -> Result<PathBuf> {
    let name = to_dir.file_name().ok_or_else(|| Error::Checkpoint {
        path: to_dir.display().to_string(),
        message: "destination has no directory name".into(),
    })?;
    let parent = to_dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(FsPath::new("."));
    let unique: u64 = rand::random();
    Ok(parent.join(format!(".{}.{tag}-{unique:016x}", name.to_string_lossy())))
}

/// One file's download attempt.
struct FileDownload<'a> {
    store: &'a Store,
    manifest: &'a Manifest,
    file: &'a ManifestFile,
    local: PathBuf,
    progress: Progress<'a>,
}

impl FileDownload<'_> {
    async fn run(&self) -> Result<()> {
        let (model, step) = (self.manifest.model.as_str(), self.manifest.step);
        let key = self.store.checkpoint_file(model, step, &self.file.path);
        if let Some(parent) = self.local.parent() {
            tokio::fs::create_dir_all(parent).await.map_err(Error::io(parent))?;
        }
        let mut out = tokio::fs::File::create(&self.local).await.map_err(Error::io(&self.local))?;
        let result = self.store.object_store().get(&key).await.map_err(store_error("get", &key))?;
        let mut stream = result.into_stream();
        let (mut hasher, mut bytes) = (Sha256::new(), 0u64);
        while let Some(chunk) = stream.try_next().await.map_err(store_error("read", &key))? {
            hasher.update(&chunk);
            bytes += chunk.len() as u64;
            out.write_all(&chunk).await.map_err(Error::io(&self.local))?;
            (self.progress)(chunk.len() as u64);
        }
        out.flush().await.map_err(Error::io(&self.local))?;
        out.sync_all().await.map_err(Error::io(&self.local))?;
        self.verify(key.as_ref(), bytes, hex::encode(hasher.finalize()))
    }

    fn verify(&self, key: &str, bytes: u64, sha256: String) -> Result<()> {
        let expected = self.file;
        let message = if bytes != expected.bytes {
            format!("size mismatch: manifest says {} bytes, downloaded {bytes}", expected.bytes)
        } else if sha256 != expected.sha256 {
            format!("sha256 mismatch: manifest says {}, downloaded {sha256}", expected.sha256)
        } else {
            return Ok(());
        };
        Err(Error::Checkpoint { path: key.to_string(), message })
    }
}
