//! `--database-url` for every command, the async runtime the commands run on, and `trainq migrate`.

use anyhow::{Context, Result};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use trainq_queue::db::databases::redact_database_url;

/// Where the database is; every command takes it.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct DatabaseArgs {
    /// PostgreSQL URL, e.g. postgres://user@host:5432/db
    #[arg(long, env = "DATABASE_URL")]
    pub(crate) database_url: String,
}

impl DatabaseArgs {
    /// A small pool on the database.
    pub(crate) async fn connect(&self, max_connections: u32) -> Result<PgPool> {
        PgPoolOptions::new()
            .max_connections(max_connections)
            .connect(&self.database_url)
            .await
            .with_context(|| format!("connect to {}", redact_database_url(&self.database_url)))
    }
}

/// Runs an async command on a fresh multi-threaded runtime (`main` is sync).
pub(crate) fn block_on<F: std::future::Future<Output = Result<()>>>(command: F) -> Result<()> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("start tokio runtime")?.block_on(command)
}

/// `trainq migrate`: install or upgrade schema `trainq`.
#[derive(clap::Args, Debug)]
pub(crate) struct MigrateArgs {
    #[command(flatten)]
    db: DatabaseArgs,
}

/// Runs the embedded migrations and says which version the database is at.
pub(crate) fn run_migrate(args: MigrateArgs) -> Result<()> {
    block_on(async move {
        let pool = args.db.connect(2).await?;
        trainq_queue::migrate(&pool).await?;
        let version: Option<i64> = sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations WHERE success")
            .fetch_one(&pool)
            .await
            .context("read migration version")?;
        println!("schema trainq is at migration {}", version.unwrap_or(0));
        Ok(())
    })
}
