//! The engine side's error type: libtorch, model files, tokenization, collectives and the
//! engine's own threads, each variant carrying what it is about.

use std::path::PathBuf;

/// Everything that can go wrong on the engine side (tch, CUDA kernels, NCCL, tokenizers).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value or an input batch is out of range or inconsistent.
    #[error("invalid config: {field}: {message}")]
    Config {
        /// The offending field, e.g. "lora.rank" or "batch".
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// A model directory or weights file could not be used.
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
    /// One of our CUDA kernels could not be compiled or launched.
    #[error("kernel: {0}")]
    Kernel(String),
    /// Rendering or tokenizing a trajectory failed.
    #[error("tokenize: {0}")]
    Tokenize(String),
    /// A collective (NCCL or the in-process test collective) failed.
    #[error("collective: {0}")]
    Collective(String),
    /// An engine or rank thread is gone (it panicked or failed to load), so no more work runs.
    #[error("training engine: {what} stopped (it panicked or failed to load)")]
    Stopped {
        /// The thread, e.g. "rank 1" or "the engine thread".
        what: String,
    },
    /// The job was cancelled before it finished (the claim was lost or the worker stops);
    /// the weights are left as they were before the job.
    #[error("training engine: job cancelled")]
    Cancelled,
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

/// `Result` with the engine side's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
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

    /// The engine thread named `what` is gone.
    pub fn stopped(what: impl Into<String>) -> Error {
        Error::Stopped { what: what.into() }
    }
}

/// Config validation lives on the queue side (the database stores the config); its errors
/// arrive here as engine config errors.
impl From<trainq_queue::Error> for Error {
    fn from(err: trainq_queue::Error) -> Error {
        match err {
            trainq_queue::Error::Config { field, message } => Error::Config { field, message },
            other => Error::Config { field: "config".into(), message: other.to_string() },
        }
    }
}
