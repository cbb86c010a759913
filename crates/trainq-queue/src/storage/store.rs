//! Where checkpoints live: an object store opened from a URL, a key prefix, the key layout
//! `{prefix}/{model}/checkpoints/{step:06}/{file}`, and which checkpoints a model has there
//! (whole ones, with a manifest, and partial ones from failed or running uploads).
//!
//! Supported URLs: `s3://bucket/prefix` (also `s3a://`), `gs://bucket/prefix`,
//! `az://container/prefix` (and the other Azure forms object_store parses), `file:///abs/dir`
//! and `memory://` (a fresh in-process store, for tests). Credentials and endpoints come from the
//! usual environment (`AWS_*`, `GOOGLE_*`, `AZURE_*`: for a local S3 server set
//! `AWS_ENDPOINT_URL=http://127.0.0.1:9000` and `AWS_ALLOW_HTTP=true`; requests are path-style
//! unless `AWS_VIRTUAL_HOSTED_STYLE_REQUEST=true`) and may be overridden per store through
//! [`StoreOptions::config`], which is what tests do instead of touching the process environment.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{BackoffConfig, ObjectStore, ObjectStoreScheme, RetryConfig};
use url::Url;

use crate::error::{Error, Result};
use crate::ids::StepNumber;

/// Name of the file, written last, that lists a checkpoint's files with sizes and sha256.
pub const MANIFEST_FILE: &str = "manifest.json";

/// Default for [`StoreOptions::retry`]: how many times one request is retried.
pub const DEFAULT_MAX_RETRIES: usize = 10;
/// Default for [`StoreOptions::retry`]: how long (from the first attempt) a request is retried.
pub const DEFAULT_RETRY_TIMEOUT: Duration = Duration::from_secs(180);

/// How a [`Store`] is opened, beyond its URL.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Backend settings as `(key, value)`, applied after the environment and so overriding it.
    /// Keys are object_store's config keys for the URL's backend, e.g. `aws_endpoint`,
    /// `aws_access_key_id`, `aws_allow_http`, `aws_region`, `timeout`, `google_service_account`.
    /// An unknown key is an error.
    pub config: Vec<(String, String)>,
    /// Retries of single requests (connect errors, 5xx, timeouts of idempotent requests) with
    /// exponential backoff. Defaults: `DEFAULT_MAX_RETRIES` within `DEFAULT_RETRY_TIMEOUT`,
    /// backoff from 100 ms doubling up to 15 s.
    pub retry: RetryConfig,
    /// Read the backend's usual environment variables (`AWS_*`, …) first. Default true.
    pub from_env: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            config: Vec::new(),
            retry: RetryConfig {
                backoff: BackoffConfig::default(),
                max_retries: DEFAULT_MAX_RETRIES,
                retry_timeout: DEFAULT_RETRY_TIMEOUT,
            },
            from_env: true,
        }
    }
}

/// An object store plus the prefix under which every model's checkpoints are kept.
#[derive(Debug, Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    prefix: Path,
    url: String,
}

impl Store {
    /// Opens the store named by `url` with credentials from the environment.
    pub fn open(url: &str) -> Result<Store> {
        Store::open_with(url, &StoreOptions::default())
    }

    /// Opens the store named by `url` with explicit options (see [`StoreOptions`]).
    pub fn open_with(url: &str, options: &StoreOptions) -> Result<Store> {
        let parsed = Url::parse(url).map_err(|e| Error::config("store", format!("{url}: {e}")))?;
        let (scheme, path) =
            ObjectStoreScheme::parse(&parsed).map_err(|e| Error::config("store", format!("{url}: {e}")))?;
        let inner: Arc<dyn ObjectStore> = match scheme {
            ObjectStoreScheme::Local => Arc::new(open_local(url, &parsed)?),
            ObjectStoreScheme::Memory => Arc::new(InMemory::new()),
            ObjectStoreScheme::AmazonS3 => open_s3(url, options)?,
            ObjectStoreScheme::GoogleCloudStorage => open_gcs(url, options)?,
            ObjectStoreScheme::MicrosoftAzure => open_azure(url, options)?,
            other => return Err(Error::config("store", format!("{url}: unsupported scheme {other:?}"))),
        };
        let prefix = match scheme {
            ObjectStoreScheme::Local => Path::default(),
            _ => Path::parse(path).map_err(|e| Error::config("store", format!("{url}: {e}")))?,
        };
        Ok(Store { inner, prefix, url: url.trim_end_matches('/').to_string() })
    }

    /// Wraps an already built object store; `url` is only used to form checkpoint URIs.
    pub fn from_object_store(inner: Arc<dyn ObjectStore>, prefix: &str, url: &str) -> Store {
        let prefix = Path::from(prefix);
        Store { inner, prefix, url: url.trim_end_matches('/').to_string() }
    }

    /// The object store itself.
    pub fn object_store(&self) -> &Arc<dyn ObjectStore> {
        &self.inner
    }

    /// The URL this store was opened from, without a trailing slash.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// `{prefix}/{model}/checkpoints`: the parent of every checkpoint of `model`.
    pub fn checkpoints_dir(&self, model: &str) -> Path {
        self.prefix.clone().join(model).join("checkpoints")
    }

    /// `{prefix}/{model}/checkpoints/{step:06}`: one checkpoint's key prefix.
    pub fn checkpoint_dir(&self, model: &str, step: StepNumber) -> Path {
        self.checkpoints_dir(model).join(step_dir_name(step))
    }

    /// The key of `file` (a relative path with `/` separators) in a checkpoint.
    pub fn checkpoint_file(&self, model: &str, step: StepNumber, file: &str) -> Path {
        file.split('/').fold(self.checkpoint_dir(model, step), |key, part| key.join(part))
    }

    /// The URI recorded in Postgres for a checkpoint: `{url}/{model}/checkpoints/{step:06}/`.
    pub fn checkpoint_uri(&self, model: &str, step: StepNumber) -> String {
        format!("{}/{model}/checkpoints/{}/", self.url, step_dir_name(step))
    }
}

/// The store's root URL from a checkpoint URI recorded in PostgreSQL
/// (`{store}/{model}/checkpoints/{step:06}/`).
pub fn store_url_of(uri: &str, model: &str, step: StepNumber) -> Result<String> {
    let tail = format!("/{model}/checkpoints/{}", step_dir_name(step));
    match uri.trim_end_matches('/').strip_suffix(&tail) {
        Some(store) if !store.is_empty() => Ok(store.to_string()),
        _ => Err(Error::Checkpoint { path: uri.to_string(), message: format!("the URI does not end in {tail}/") }),
    }
}

/// A step's directory name: zero-padded to six digits so that keys sort by step.
pub fn step_dir_name(step: StepNumber) -> String {
    format!("{step:06}")
}

/// The objects of one step's checkpoint directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredCheckpoint {
    /// The step, parsed from the directory name.
    pub step: StepNumber,
    /// True when `manifest.json` exists: the checkpoint is whole.
    pub has_manifest: bool,
    /// Every object key under the step's directory, manifest included.
    pub objects: Vec<Path>,
}

/// Lists every checkpoint directory of `model`, sorted by step. Directories whose name is not a
/// step number are ignored.
pub async fn list_checkpoints(store: &Store, model: &str) -> Result<Vec<StoredCheckpoint>> {
    let dir = store.checkpoints_dir(model);
    let metas: Vec<_> = store.object_store().list(Some(&dir)).try_collect().await.map_err(|source| Error::Store {
        what: "list",
        path: dir.to_string(),
        source,
    })?;
    let depth = dir.parts().count();
    let mut by_step: BTreeMap<StepNumber, StoredCheckpoint> = BTreeMap::new();
    for meta in metas {
        let parts: Vec<_> = meta.location.parts().skip(depth).collect();
        let Some(step) = parts.first().and_then(|p| p.as_ref().parse::<i64>().ok().map(StepNumber)) else {
            continue;
        };
        let entry =
            by_step.entry(step).or_insert_with(|| StoredCheckpoint { step, has_manifest: false, objects: Vec::new() });
        if parts.len() == 2 && parts[1].as_ref() == MANIFEST_FILE {
            entry.has_manifest = true;
        }
        entry.objects.push(meta.location);
    }
    Ok(by_step.into_values().collect())
}

/// The steps of `model` whose checkpoint is whole (manifest present), ascending.
pub async fn complete_steps(store: &Store, model: &str) -> Result<Vec<StepNumber>> {
    let listed = list_checkpoints(store, model).await?;
    Ok(listed.into_iter().filter(|c| c.has_manifest).map(|c| c.step).collect())
}

/// The highest step of `model` whose manifest exists, if any.
pub async fn latest_complete_step(store: &Store, model: &str) -> Result<Option<StepNumber>> {
    Ok(complete_steps(store, model).await?.last().copied())
}

/// `file:///abs/dir`: a local directory, created when missing.
fn open_local(url: &str, parsed: &Url) -> Result<LocalFileSystem> {
    let dir =
        parsed.to_file_path().map_err(|()| Error::config("store", format!("{url}: not an absolute file path")))?;
    std::fs::create_dir_all(&dir).map_err(Error::io(&dir))?;
    LocalFileSystem::new_with_prefix(&dir).map_err(|source| Error::Store {
        what: "open",
        path: url.to_string(),
        source,
    })
}

fn open_s3(url: &str, options: &StoreOptions) -> Result<Arc<dyn ObjectStore>> {
    let base = if options.from_env { AmazonS3Builder::from_env() } else { AmazonS3Builder::new() };
    let mut builder = base.with_url(url).with_retry(options.retry.clone());
    for (key, value) in &options.config {
        let key: AmazonS3ConfigKey = key.to_ascii_lowercase().parse().map_err(config_key(url))?;
        builder = builder.with_config(key, value);
    }
    let store = builder.build().map_err(open_error(url))?;
    Ok(Arc::new(store))
}

fn open_gcs(url: &str, options: &StoreOptions) -> Result<Arc<dyn ObjectStore>> {
    let base = if options.from_env { GoogleCloudStorageBuilder::from_env() } else { GoogleCloudStorageBuilder::new() };
    let mut builder = base.with_url(url).with_retry(options.retry.clone());
    for (key, value) in &options.config {
        let key: GoogleConfigKey = key.to_ascii_lowercase().parse().map_err(config_key(url))?;
        builder = builder.with_config(key, value);
    }
    Ok(Arc::new(builder.build().map_err(open_error(url))?))
}

fn open_azure(url: &str, options: &StoreOptions) -> Result<Arc<dyn ObjectStore>> {
    let base = if options.from_env { MicrosoftAzureBuilder::from_env() } else { MicrosoftAzureBuilder::new() };
    let mut builder = base.with_url(url).with_retry(options.retry.clone());
    for (key, value) in &options.config {
        let key: AzureConfigKey = key.to_ascii_lowercase().parse().map_err(config_key(url))?;
        builder = builder.with_config(key, value);
    }
    Ok(Arc::new(builder.build().map_err(open_error(url))?))
}

fn config_key(url: &str) -> impl FnOnce(object_store::Error) -> Error + '_ {
    move |e| Error::config("store", format!("{url}: {e}"))
}

fn open_error(url: &str) -> impl FnOnce(object_store::Error) -> Error + '_ {
    move |source| Error::Store { what: "open", path: url.to_string(), source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_keys_are_prefixed_zero_padded_and_nested() {
        let store = Store::from_object_store(Arc::new(InMemory::new()), "runs/a", "s3://b/runs/a/");
        assert_eq!(store.checkpoint_dir("m1", StepNumber(42)).as_ref(), "runs/a/m1/checkpoints/000042");
        assert_eq!(
            store.checkpoint_file("m1", StepNumber(7), "sub/adapter.safetensors").as_ref(),
            "runs/a/m1/checkpoints/000007/sub/adapter.safetensors"
        );
        assert_eq!(store.checkpoint_uri("m1", StepNumber(7)), "s3://b/runs/a/m1/checkpoints/000007/");
    }

    #[test]
    fn s3_urls_open_with_explicit_endpoint_and_unknown_keys_are_refused() {
        let mut options = StoreOptions { from_env: false, ..StoreOptions::default() };
        options.config.push(("aws_endpoint".into(), "http://127.0.0.1:1".into()));
        options.config.push(("aws_allow_http".into(), "true".into()));
        let store = Store::open_with("s3://bucket/some/prefix", &options).unwrap();
        assert_eq!(store.checkpoints_dir("m").as_ref(), "some/prefix/m/checkpoints");
        options.config.push(("no_such_key".into(), "x".into()));
        let err = Store::open_with("s3://bucket/p", &options).unwrap_err();
        assert!(err.to_string().contains("no_such_key"), "{err}");
    }

    #[test]
    fn file_urls_create_the_directory_and_other_schemes_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}/store", dir.path().display());
        let store = Store::open(&url).unwrap();
        assert!(dir.path().join("store").is_dir());
        assert_eq!(store.checkpoint_dir("m", StepNumber(1)).as_ref(), "m/checkpoints/000001");
        assert!(Store::open("ftp://host/x").is_err());
    }
}
