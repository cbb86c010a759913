//! A fresh, migrated PostgreSQL database per test (`trainq_test_<uuid>` on $DATABASE_URL's server),
//! dropped when the [`TestDb`] goes out of scope, plus builders for groups and models.

use serde_json::{json, Value};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use uuid::Uuid;

/// A test's own database.
pub struct TestDb {
    /// Pool connected as the server's admin user (the table owner).
    pub pool: PgPool,
    /// Database name.
    pub name: String,
    admin_url: url::Url,
}

fn admin_url() -> url::Url {
    let raw = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    url::Url::parse(&raw).expect("DATABASE_URL is a URL")
}

fn url_of(admin: &url::Url, database: &str, user: Option<&str>) -> String {
    let mut url = admin.clone();
    url.set_path(database);
    if let Some(user) = user {
        url.set_username(user).unwrap();
        url.set_password(None).unwrap();
    }
    url.to_string()
}

async fn pool_for(url: &str, max: u32) -> PgPool {
    PgPoolOptions::new().max_connections(max).connect(url).await.expect("connect to test database")
}

impl TestDb {
    /// Creates `trainq_test_<uuid>` and runs trainq's migrations on it.
    pub async fn new() -> TestDb {
        let admin_url = admin_url();
        let name = format!("trainq_test_{}", Uuid::now_v7().simple());
        let admin = PgPool::connect(admin_url.as_str()).await.expect("connect to $DATABASE_URL");
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.expect("create test database");
        admin.close().await;
        let pool = pool_for(&url_of(&admin_url, &name, None), 20).await;
        trainq_queue::migrate(&pool).await.expect("migrations run");
        TestDb { pool, name, admin_url }
    }

    /// The URL of this database, as `user` (default: $DATABASE_URL's user).
    pub fn url(&self, user: Option<&str>) -> String {
        url_of(&self.admin_url, &self.name, user)
    }

    /// A new pool on this database, as `user`, with up to `max` connections.
    pub async fn connect_as(&self, user: Option<&str>, max: u32) -> PgPool {
        pool_for(&self.url(user), max).await
    }

    /// Registers model `name` with the default config.
    pub async fn create_model(&self, name: &str) {
        trainq_queue::db::create_model(&self.pool, &trainq_queue::db::NewModel::new(name, "/models/base"))
            .await
            .unwrap();
    }

    /// Number of rows in trainq.groups.
    pub async fn group_count(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM trainq.groups").fetch_one(&self.pool).await.unwrap()
    }
}

/// Runs one statement as the admin user from a thread and runtime of its own, because `Drop` may
/// run inside (or after) the test's runtime; prints what went wrong.
fn run_admin_statement(sql: String) {
    let url = admin_url().to_string();
    let outcome = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let admin = PgPool::connect(&url).await?;
            sqlx::query(&sql).execute(&admin).await?;
            admin.close().await;
            Ok::<_, sqlx::Error>(())
        })
    })
    .join();
    if let Ok(Err(err)) = outcome {
        eprintln!("test cleanup failed: {err}");
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        run_admin_statement(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name));
    }
}

/// A chat trajectory (user question, assistant answer) with `reward`.
pub fn chat_trajectory(reward: f64) -> Value {
    json!({
        "messages": [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"}
        ],
        "reward": reward
    })
}

/// A group of chat trajectories, one per reward.
pub fn chat_group(rewards: &[f64]) -> Value {
    Value::Array(rewards.iter().map(|r| chat_trajectory(*r)).collect())
}

/// Inserts `n` groups of model `model` (rewards [0, 1]) in one statement, through the trigger.
pub async fn insert_groups(pool: &PgPool, model: &str, n: i64) {
    sqlx::query(
        "INSERT INTO trainq.groups (model, trajectories) \
         SELECT $1, $2 FROM generate_series(1, $3)",
    )
    .bind(model)
    .bind(chat_group(&[0.0, 1.0]))
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

/// A login role for one test (cluster-wide, so uniquely named), member of `group`; dropped at the end.
pub struct TestRole {
    /// Role name.
    pub name: String,
}

impl TestRole {
    /// Creates `tq_<prefix>_<uuid>` with LOGIN, member of `group` (e.g. `trainq_producer`).
    pub async fn new(db: &TestDb, prefix: &str, group: &str) -> TestRole {
        let name = format!("tq_{prefix}_{}", Uuid::now_v7().simple());
        sqlx::query(&format!("CREATE ROLE {name} LOGIN IN ROLE {group}")).execute(&db.pool).await.unwrap();
        TestRole { name }
    }
}

impl Drop for TestRole {
    fn drop(&mut self) {
        run_admin_statement(format!("DROP ROLE IF EXISTS {}", self.name));
    }
}
