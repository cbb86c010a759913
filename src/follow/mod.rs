//! `trainq follow`: keep an inference host on a model's newest checkpoint. Wait for each new
//! committed checkpoint (`LISTEN trainq_checkpoints` + poll, always re-reading
//! `trainq.latest_checkpoint()`: a notification is only a wake-up, and a producer can send one),
//! fetch it verified against its manifest into `DIR/{step:06}`, swap `DIR/current` onto it in one
//! rename, tell the inference server, keep the last K. Every error is taken as transient: logged,
//! then retried with backoff, so a database or store restart only delays the follower.

pub mod directory;
pub mod notify;

use std::path::PathBuf;
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use trainq_queue::queue::{wait_for_checkpoint, LatestCheckpoint};
use trainq_queue::storage::{fetch_checkpoint, FetchOptions, Store, StoreOptions};
use trainq_queue::StepNumber;

pub use directory::{current_step, step_dir, CURRENT_LINK};
pub use notify::{adapter_name, VllmServer};

use crate::{Error, Result};

/// Step directories kept under `DIR` by default (the newest; `current` always among them).
pub const DEFAULT_KEEP: usize = 3;
/// The longest wait between two attempts after errors.
pub const DEFAULT_MAX_BACKOFF: Duration = Duration::from_secs(30);
/// The first wait after an error; it doubles up to the maximum and resets after a success.
pub const FIRST_BACKOFF: Duration = Duration::from_millis(500);
/// How long one wait for a newer checkpoint lasts before it is begun again (a fresh listener).
const WAIT_SLICE: Duration = Duration::from_secs(300);

/// What `trainq follow` follows and whom it tells.
#[derive(Debug, Clone)]
pub struct FollowOptions {
    /// The model.
    pub model: String,
    /// The local directory: `DIR/{step:06}` per fetched step and the symlink `DIR/current`.
    pub dir: PathBuf,
    /// Step directories kept. Default [`DEFAULT_KEEP`].
    pub keep: usize,
    /// The store to read from instead of the one in the checkpoint's recorded URI.
    pub store_url: Option<String>,
    /// Store settings (credentials, endpoint, retries); by default from the environment.
    pub store_options: StoreOptions,
    /// A vLLM server to load each new adapter into (and unload the previous one from).
    pub vllm: Option<String>,
    /// A shell command run after each new checkpoint is in place (see [`notify::run_hook`]).
    pub exec: Option<String>,
    /// The longest wait between attempts after errors. Default [`DEFAULT_MAX_BACKOFF`].
    pub max_backoff: Duration,
}

impl FollowOptions {
    /// Follows `model` into `dir` with the defaults.
    pub fn new(model: &str, dir: impl Into<PathBuf>) -> FollowOptions {
        FollowOptions {
            model: model.to_string(),
            dir: dir.into(),
            keep: DEFAULT_KEEP,
            store_url: None,
            store_options: StoreOptions::default(),
            vllm: None,
            exec: None,
            max_backoff: DEFAULT_MAX_BACKOFF,
        }
    }
}

/// Where the follower stands: the newest step in `DIR/current`, the newest step the inference
/// server was told about, and the adapter name it holds from us.
struct Follower<'a> {
    options: &'a FollowOptions,
    vllm: Option<VllmServer>,
    fetched: StepNumber,
    announced: StepNumber,
    loaded_adapter: Option<String>,
}

/// Follows the model until `stop` is cancelled; returns `Ok` then. Only a bad setup (the
/// directory cannot be created, the vLLM URL is unusable) ends it with an error; everything
/// else is retried.
pub async fn follow_checkpoints(pool: &PgPool, options: &FollowOptions, stop: &CancellationToken) -> Result<()> {
    std::fs::create_dir_all(&options.dir)
        .map_err(|err| Error::Follow { what: format!("create {}", options.dir.display()), message: err.to_string() })?;
    let vllm = options.vllm.as_deref().map(VllmServer::new).transpose()?;
    let fetched = current_step(&options.dir).unwrap_or(StepNumber::BASE);
    let mut follower = Follower { options, vllm, fetched, announced: StepNumber::BASE, loaded_adapter: None };
    if fetched > StepNumber::BASE {
        tracing::info!(model = %options.model, "{} holds step {fetched}; announcing it again", options.dir.display());
    }
    let mut backoff = FIRST_BACKOFF;
    loop {
        let attempt = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            attempt = follower.advance(pool) => attempt,
        };
        match attempt {
            Ok(()) => backoff = FIRST_BACKOFF,
            Err(err) => {
                tracing::warn!(model = %options.model, "follow: {err}; retrying in {backoff:?}");
                tokio::select! {
                    _ = stop.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(options.max_backoff.max(FIRST_BACKOFF));
            }
        }
    }
}

impl Follower<'_> {
    /// One move: announce a fetched step the server has not heard of, else wait for a newer
    /// checkpoint and put it in place.
    async fn advance(&mut self, pool: &PgPool) -> Result<()> {
        if self.fetched > self.announced {
            return self.announce(self.fetched).await;
        }
        let latest = match wait_for_checkpoint(pool, &self.options.model, self.fetched, WAIT_SLICE).await {
            Ok(latest) => latest,
            Err(trainq_queue::Error::NotFound { .. }) => return Ok(()),
            Err(err) => return Err(err.into()),
        };
        self.fetch(&latest).await?;
        self.fetched = latest.step;
        self.announce(latest.step).await
    }

    /// Fetches `latest` (as read from `trainq.latest_checkpoint()`, never from a notification)
    /// into `DIR/{step:06}`, checks it against the committed record, and points `DIR/current` at it.
    async fn fetch(&self, latest: &LatestCheckpoint) -> Result<()> {
        let (model, step) = (&self.options.model, latest.step);
        let store_url = self.options.store_url.as_deref().unwrap_or(&latest.store_url);
        let store = Store::open_with(store_url, &self.options.store_options)?;
        let to = step_dir(&self.options.dir, step);
        // The manifest must be the one the commit recorded (checked before any file is fetched).
        let fetch_options = FetchOptions {
            replace_existing: true,
            expected_manifest_sha256: Some(latest.sha256.clone()),
            ..FetchOptions::default()
        };
        let manifest = fetch_checkpoint(&store, model, step, &to, &fetch_options, &|_| {}).await?;
        directory::swap_current(&self.options.dir, step)?;
        tracing::info!(
            model = %model,
            "step {step} in place: {} ({} files, {} bytes, sha256 verified)",
            to.display(),
            manifest.files.len(),
            manifest.total_bytes
        );
        Ok(())
    }

    /// Tells the inference server about `step` (load the new adapter, then unload ours from
    /// before; or run the hook) and prunes old step directories.
    async fn announce(&mut self, step: StepNumber) -> Result<()> {
        let model = &self.options.model;
        let path = std::path::absolute(step_dir(&self.options.dir, step)).map_err(|err| Error::Follow {
            what: "absolute path of the checkpoint".into(),
            message: err.to_string(),
        })?;
        if let Some(vllm) = &self.vllm {
            let name = adapter_name(model, step);
            if let Err(err) = vllm.load(&name, &path).await {
                if !err.to_string().contains("already") {
                    return Err(err);
                }
            }
            tracing::info!(model = %model, "vLLM loaded adapter {name} from {}", path.display());
            if let Some(previous) = self.loaded_adapter.replace(name.clone()).filter(|p| *p != name) {
                if let Err(err) = vllm.unload(&previous).await {
                    tracing::warn!(model = %model, "vLLM did not unload {previous}: {err}");
                }
            }
        }
        if let Some(command) = &self.options.exec {
            notify::run_hook(command, model, step, &path).await?;
        }
        self.announced = step;
        let pruned = directory::prune(&self.options.dir, self.options.keep)?;
        if !pruned.is_empty() {
            tracing::info!(model = %model, "removed old step directories {pruned:?}");
        }
        Ok(())
    }
}
