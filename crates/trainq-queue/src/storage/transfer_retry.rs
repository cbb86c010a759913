//! Whole-file retries for checkpoint transfers, on top of object_store's per-request retries.
//!
//! object_store retries one HTTP request (connect errors, 5xx, timeouts) within its
//! `RetryConfig` window. Some failures need the whole file redone instead: a multipart upload
//! whose upload id the server forgot (it restarted), a download stream cut in the middle. This
//! module decides which errors are worth another attempt and runs the attempts with backoff.

use std::future::Future;
use std::time::Duration;

use crate::error::{Error, Result};

/// Default for [`FileRetry::attempts`].
pub const DEFAULT_FILE_ATTEMPTS: u32 = 3;
/// Default for [`FileRetry::first_backoff`].
pub const DEFAULT_FILE_BACKOFF: Duration = Duration::from_millis(500);

/// How often one file transfer is attempted, and how long to wait in between.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileRetry {
    /// Attempts in all, at least 1. Default [`DEFAULT_FILE_ATTEMPTS`].
    pub attempts: u32,
    /// Wait before the second attempt; doubled before each later one. Default
    /// [`DEFAULT_FILE_BACKOFF`].
    pub first_backoff: Duration,
}

impl Default for FileRetry {
    fn default() -> Self {
        FileRetry { attempts: DEFAULT_FILE_ATTEMPTS, first_backoff: DEFAULT_FILE_BACKOFF }
    }
}

impl FileRetry {
    /// Runs `attempt` until it succeeds, fails with an error that another try cannot fix, or
    /// runs out of attempts; `what` names the transfer in the log.
    pub async fn run<T, F, Fut>(&self, what: &str, mut attempt: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let mut backoff = self.first_backoff;
        let mut tried = 1;
        loop {
            match attempt().await {
                Ok(value) => return Ok(value),
                Err(error) if tried < self.attempts.max(1) && is_transient(&error) => {
                    tracing::warn!(%error, attempt = tried, "{what} failed; retrying in {backoff:?}");
                    tokio::time::sleep(backoff).await;
                    backoff = backoff.saturating_mul(2);
                    tried += 1;
                }
                Err(error) => return Err(error),
            }
        }
    }
}

/// True for errors another attempt may cure: store errors other than refusals (bad
/// credentials, bad paths, unsupported operations) and content mismatches seen on download.
pub fn is_transient(error: &Error) -> bool {
    use object_store::Error as Store;
    match error {
        Error::Store { source, .. } => !matches!(
            source,
            Store::PermissionDenied { .. }
                | Store::Unauthenticated { .. }
                | Store::InvalidPath { .. }
                | Store::NotSupported { .. }
                | Store::NotImplemented { .. }
                | Store::UnknownConfigurationKey { .. }
        ),
        Error::Checkpoint { .. } => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn store_error(source: object_store::Error) -> Error {
        Error::Store { what: "put", path: "p".into(), source }
    }

    #[test]
    fn refusals_and_local_errors_are_not_retried_but_server_errors_are() {
        let generic = object_store::Error::Generic { store: "S3", source: "503".into() };
        assert!(is_transient(&store_error(generic)));
        let denied = object_store::Error::PermissionDenied { path: "p".into(), source: "no".into() };
        assert!(!is_transient(&store_error(denied)));
        let io = Error::Io { path: "x".into(), source: std::io::Error::other("disk") };
        assert!(!is_transient(&io));
    }

    #[tokio::test]
    async fn transient_failures_are_retried_until_the_attempts_run_out() {
        let retry = FileRetry { attempts: 3, first_backoff: Duration::from_millis(1) };
        let calls = Cell::new(0);
        let result: Result<()> = retry
            .run("test", || {
                calls.set(calls.get() + 1);
                async { Err(Error::Checkpoint { path: "f".into(), message: "short".into() }) }
            })
            .await;
        assert!(result.is_err());
        assert_eq!(calls.get(), 3);
        calls.set(0);
        let ok = retry
            .run("test", || {
                calls.set(calls.get() + 1);
                let n = calls.get();
                async move {
                    if n < 2 {
                        return Err(Error::Checkpoint { path: "f".into(), message: "x".into() });
                    }
                    Ok(n)
                }
            })
            .await
            .unwrap();
        assert_eq!(ok, 2);
    }
}
