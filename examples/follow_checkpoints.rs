//! An inference host's loop: wait for each new checkpoint of a model, fetch it (verified
//! against its manifest) into `DIR/{step:06}`, and say where it is.
//!
//! `cargo run --no-default-features --example follow_checkpoints -- MODEL DIR` with
//! `DATABASE_URL` set and the store's credentials in the environment (`AWS_*` for S3). Needs no
//! libtorch. Stop it with ctrl-C.

use std::path::PathBuf;
use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (model, dir) = match (args.next(), args.next()) {
        (Some(model), Some(dir)) => (model, PathBuf::from(dir)),
        _ => return Err("usage: follow_checkpoints MODEL DIR".into()),
    };
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let pool = sqlx::PgPool::connect(&url).await?;

    let mut have = trainq::StepNumber::BASE;
    loop {
        let latest = match trainq::wait_for_checkpoint(&pool, &model, have, Duration::from_secs(3600)).await {
            Ok(latest) => latest,
            Err(trainq::QueueError::NotFound { .. }) => continue, // nothing new this hour
            Err(err) => return Err(err.into()),
        };
        let store = trainq::Store::open_with(&latest.store_url, &trainq::StoreOptions::default())?;
        let to = dir.join(format!("{:06}", latest.step));
        let options = trainq::FetchOptions { replace_existing: true, ..trainq::FetchOptions::default() };
        let manifest = trainq::fetch_checkpoint(&store, &model, latest.step, &to, &options, &|_| {}).await?;
        println!(
            "step {} ready in {} ({} bytes, manifest sha256 {})",
            latest.step,
            to.display(),
            manifest.total_bytes,
            latest.sha256
        );
        have = latest.step;
    }
}
