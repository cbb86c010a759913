//! The queue side's error type: each variant says which model, group, step or path it is about,
//! and the ones a caller acts on (`LostClaim`, `StepTaken`, `UnknownModel`, `NotFound`) are
//! their own variants rather than text.

use std::path::PathBuf;

use crate::ids::StepNumber;

/// Everything that can go wrong on the queue side (PostgreSQL, object storage, config).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A PostgreSQL query failed; `what` names the operation.
    #[error("database: {what}: {source}")]
    Database {
        /// The operation that failed, e.g. "claim groups for model m1".
        what: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// Running the embedded migrations failed.
    #[error("migrations: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A configuration value is out of range or inconsistent.
    #[error("invalid config: {field}: {message}")]
    Config {
        /// The offending field, e.g. "lora.rank".
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// A model name that is not registered.
    #[error("unknown model {0:?}")]
    UnknownModel(String),
    /// Something looked up by name or step does not exist (a checkpoint, a manifest).
    #[error("not found: {what}")]
    NotFound {
        /// What was looked for, e.g. "checkpoint of model m1 at step 3".
        what: String,
    },
    /// The claim token no longer holds: another worker or the rescuer took the groups.
    #[error("lost the claim on {groups} group(s) of model {model:?}")]
    LostClaim {
        /// Model whose groups were claimed.
        model: String,
        /// How many groups the fenced write expected to update.
        groups: usize,
    },
    /// Another worker committed this step first; the model is now at `now_at`.
    #[error("step {step} of model {model:?} was committed by another worker (model now at step {now_at})")]
    StepTaken {
        /// The model.
        model: String,
        /// The step this worker tried to commit.
        step: StepNumber,
        /// The model's current step as found.
        now_at: StepNumber,
    },
    /// Ranks could not meet through `trainq.rendezvous` in time.
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    /// An object-store operation failed.
    #[error("object store: {what} {path}: {source}")]
    Store {
        /// The operation, e.g. "put".
        what: &'static str,
        /// The object path or URL.
        path: String,
        /// The store's error.
        #[source]
        source: object_store::Error,
    },
    /// A checkpoint's files do not match its manifest (or the manifest is unusable).
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The file or checkpoint location.
        path: String,
        /// What does not match.
        message: String,
    },
    /// Local file I/O failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// JSON (de)serialization failed.
    #[error("json: {what}: {source}")]
    Json {
        /// What was being read or written.
        what: String,
        /// serde_json's error.
        #[source]
        source: serde_json::Error,
    },
}

/// `Result` with the queue side's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Wraps a sqlx error with the operation it belongs to.
    pub fn db(what: impl Into<String>) -> impl FnOnce(sqlx::Error) -> Error {
        let what = what.into();
        move |source| Error::Database { what, source }
    }

    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { path, source }
    }

    /// Wraps a serde_json error with what was being read or written.
    pub fn json(what: impl Into<String>) -> impl FnOnce(serde_json::Error) -> Error {
        let what = what.into();
        move |source| Error::Json { what, source }
    }

    /// A config error for `field`.
    pub fn config(field: impl Into<String>, message: impl Into<String>) -> Error {
        Error::Config { field: field.into(), message: message.into() }
    }
}
