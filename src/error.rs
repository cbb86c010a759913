//! The crate's one error type: every variant says which model, group, step or path it is about.

use std::path::PathBuf;

/// Everything that can go wrong in trainq, with the context needed to act on it.
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
    /// The claim token no longer holds: another worker or the rescuer took the groups.
    #[error("lost the claim on {groups} group(s) of model {model:?}")]
    LostClaim {
        /// Model whose groups were claimed.
        model: String,
        /// How many groups the fenced write expected to update.
        groups: usize,
    },
    /// A model directory or checkpoint could not be used.
    #[error("model {path}: {message}")]
    Model {
        /// The model directory or file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A libtorch call failed.
    #[error("torch: {what}: {source}")]
    Torch {
        /// The operation that failed.
        what: String,
        /// libtorch's error.
        #[source]
        source: tch::TchError,
    },
    /// Rendering or tokenizing a trajectory failed.
    #[error("tokenize: {0}")]
    Tokenize(String),
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
    /// A downloaded checkpoint file does not match its manifest.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The file or checkpoint location.
        path: String,
        /// What does not match.
        message: String,
    },
    /// A collective (NCCL or the in-process test collective) failed.
    #[error("collective: {0}")]
    Collective(String),
    /// The training engine thread stopped or refused a job.
    #[error("training engine: {0}")]
    Engine(String),
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

/// `Result` with the crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Wraps a sqlx error with the operation it belongs to.
    pub fn db(what: impl Into<String>) -> impl FnOnce(sqlx::Error) -> Error {
        let what = what.into();
        move |source| Error::Database { what, source }
    }

    /// Wraps a libtorch error with the operation it belongs to.
    pub fn torch(what: impl Into<String>) -> impl FnOnce(tch::TchError) -> Error {
        let what = what.into();
        move |source| Error::Torch { what, source }
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

    /// A model-loading error for `path`.
    pub fn model(path: impl Into<PathBuf>, message: impl Into<String>) -> Error {
        Error::Model { path: path.into(), message: message.into() }
    }
}
