//! Whole databases: creating a fresh one for the demo (and anything else that wants its own).

use sqlx::PgPool;

use crate::error::{Error, Result};

/// Drops database `name` if it exists (closing its sessions) and creates it empty; returns the
/// URL of the new database on the same server as `server_url`.
pub async fn recreate_database(server_url: &str, name: &str) -> Result<String> {
    if !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(Error::config("database", format!("{name:?}: use letters, digits and _")));
    }
    let admin = PgPool::connect(server_url).await.map_err(Error::db(format!("connect to {server_url}")))?;
    for statement in [format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"), format!("CREATE DATABASE {name}")] {
        sqlx::query(&statement).execute(&admin).await.map_err(Error::db(statement.clone()))?;
    }
    admin.close().await;
    let mut url = url::Url::parse(server_url).map_err(|e| Error::config("database url", e.to_string()))?;
    url.set_path(name);
    Ok(url.to_string())
}
