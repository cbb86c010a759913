//! The worker's error type: the queue side's and the engine side's errors, plus what only the
//! worker knows (it is shutting down). Callers act on the variants: a lost claim or a step
//! another worker committed gives the groups back; a shutdown ends the run.

/// Everything that can end a worker run or a step, by layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// PostgreSQL, object storage or config (`trainq_queue`): includes
    /// [`trainq_queue::Error::LostClaim`] and [`trainq_queue::Error::StepTaken`].
    #[error(transparent)]
    Queue(#[from] trainq_queue::Error),
    /// Training, tokenization, model files, collectives (`trainq_engine`).
    #[cfg(feature = "engine")]
    #[error(transparent)]
    Engine(#[from] trainq_engine::Error),
    /// The worker was asked to stop (SIGTERM, ctrl-C, the embedder's token).
    #[error("the worker is shutting down")]
    Shutdown,
    /// The step before this one was trained first and committed in the background (async
    /// weight syncing), and that step was not committed: this step trained (or was prepared to
    /// train) on weights that are not the model's, so its groups go back without counting an
    /// attempt.
    #[error("step {step} was not committed, so the step after it is given back")]
    PreviousStepNotCommitted {
        /// The step whose commit failed.
        step: trainq_queue::StepNumber,
    },
    /// Following checkpoints (`trainq follow`): a local file operation, the inference server's
    /// answer or the hook's exit status.
    #[error("{what}: {message}")]
    Follow {
        /// What was being done, e.g. "POST http://…/v1/load_lora_adapter".
        what: String,
        /// What went wrong.
        message: String,
    },
    /// A task the worker spawned panicked or was aborted.
    #[error("{what} failed: {message}")]
    Task {
        /// The task, e.g. "tokenizer task".
        what: &'static str,
        /// The join error.
        message: String,
    },
}

/// `Result` with the worker's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Wraps a task's join error.
    #[cfg(feature = "engine")]
    pub(crate) fn task(what: &'static str) -> impl FnOnce(tokio::task::JoinError) -> Error {
        move |err| Error::Task { what, message: err.to_string() }
    }
}
