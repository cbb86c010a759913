//! A `LISTEN` connection that comes back: when it is lost (the server restarted, an operator
//! terminated the backend, a proxy cut it) it is opened again with backoff, while the waiter
//! sleeps to its poll deadline meanwhile. A waiter treats every wake-up, a re-established
//! connection included, as "look at the table": notifications sent while it was gone are lost.

use std::time::Duration;

use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio::time::Instant;

use crate::error::{Error, Result};

/// The first wait before opening a lost LISTEN connection again (after one failed attempt; the
/// first attempt is immediate); it doubles up to [`MAX_RELISTEN_BACKOFF`].
pub const FIRST_RELISTEN_BACKOFF: Duration = Duration::from_millis(500);
/// The longest wait between two attempts to open a lost LISTEN connection again.
pub const MAX_RELISTEN_BACKOFF: Duration = Duration::from_secs(30);

/// What ended one [`Listener::wake_before`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wake {
    /// A notification arrived, with its payload.
    Notified(String),
    /// The connection was lost and is back: anything may have happened meanwhile.
    Reconnected,
    /// The deadline passed.
    TimedOut,
}

/// A LISTEN connection on one channel that re-establishes itself after it is lost.
#[derive(Debug)]
pub struct Listener {
    pool: PgPool,
    channel: &'static str,
    connection: Option<PgListener>,
    backoff: Duration,
    retry_at: Instant,
}

impl Listener {
    /// Opens a connection and LISTENs on `channel`; fails if that first attempt does.
    pub async fn connect(pool: &PgPool, channel: &'static str) -> Result<Listener> {
        let connection = open(pool, channel).await?;
        Ok(Listener {
            pool: pool.clone(),
            channel,
            connection: Some(connection),
            backoff: FIRST_RELISTEN_BACKOFF,
            retry_at: Instant::now(),
        })
    }

    /// Like [`Listener::connect`], but a failed first attempt only logs and is retried with
    /// backoff (the caller polls meanwhile).
    pub async fn connect_or_retry(pool: &PgPool, channel: &'static str) -> Listener {
        let mut listener = Listener {
            pool: pool.clone(),
            channel,
            connection: None,
            backoff: FIRST_RELISTEN_BACKOFF,
            retry_at: Instant::now(),
        };
        listener.reopen().await;
        listener
    }

    /// Whether the LISTEN connection is open now.
    pub fn is_connected(&self) -> bool {
        self.connection.is_some()
    }

    /// Waits until `deadline` for a notification. A lost connection is opened again (at once,
    /// then with backoff), and a successful reopening wakes the caller.
    pub async fn wake_before(&mut self, deadline: Instant) -> Wake {
        loop {
            let Some(connection) = self.connection.as_mut() else {
                if Instant::now() < self.retry_at {
                    tokio::time::sleep_until(self.retry_at.min(deadline)).await;
                }
                if Instant::now() >= deadline {
                    return Wake::TimedOut;
                }
                if self.reopen().await {
                    tracing::info!("LISTEN {} re-established", self.channel);
                    return Wake::Reconnected;
                }
                continue;
            };
            match tokio::time::timeout_at(deadline, connection.recv()).await {
                Err(_elapsed) => return Wake::TimedOut,
                Ok(Ok(note)) => return Wake::Notified(note.payload().to_string()),
                Ok(Err(err)) => {
                    tracing::warn!("LISTEN {} lost ({err}); polling until it is back", self.channel);
                    self.connection = None;
                    self.retry_at = Instant::now();
                }
            }
        }
    }

    /// One attempt to open the connection again; true when it is open.
    async fn reopen(&mut self) -> bool {
        match open(&self.pool, self.channel).await {
            Ok(connection) => {
                self.connection = Some(connection);
                self.backoff = FIRST_RELISTEN_BACKOFF;
                true
            }
            Err(err) => {
                tracing::warn!("LISTEN {} unavailable, retrying in {:?}: {err}", self.channel, self.backoff);
                self.retry_at = Instant::now() + self.backoff;
                self.backoff = next_backoff(self.backoff);
                false
            }
        }
    }
}

async fn open(pool: &PgPool, channel: &'static str) -> Result<PgListener> {
    let mut listener =
        PgListener::connect_with(pool).await.map_err(Error::db(format!("connect to LISTEN {channel}")))?;
    listener.listen(channel).await.map_err(Error::db(format!("LISTEN {channel}")))?;
    Ok(listener)
}

/// The next wait after `backoff`: doubled, capped.
fn next_backoff(backoff: Duration) -> Duration {
    (backoff * 2).min(MAX_RELISTEN_BACKOFF)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_relisten_backoff_doubles_up_to_its_cap() {
        let mut b = FIRST_RELISTEN_BACKOFF;
        let mut seen = Vec::new();
        for _ in 0..10 {
            seen.push(b);
            b = next_backoff(b);
        }
        assert_eq!(seen[1], Duration::from_secs(1));
        assert_eq!(*seen.last().unwrap(), MAX_RELISTEN_BACKOFF);
    }
}
