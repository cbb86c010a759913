//! A trainq worker inside your own tokio program, stopped by your own shutdown signal.
//!
//! `cargo run --release --example embedded_worker -- MODEL STORE_URL` with `DATABASE_URL` set
//! (e.g. `file:///tmp/trainq-store` as the store). It trains on the first CUDA device when there
//! is one, else on the CPU, and stops cleanly on ctrl-C: the step in flight is finished or
//! abandoned and its groups go back to the queue without counting an attempt.

use trainq::{CancellationToken, Device, Placement};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (model, store) = match (args.next(), args.next()) {
        (Some(model), Some(store)) => (model, store),
        _ => return Err("usage: embedded_worker MODEL STORE_URL".into()),
    };
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let pool = sqlx::PgPool::connect(&url).await?;

    let device = Device::cuda_if_available();
    let options = trainq::WorkerOptions::new(&model, &store, Placement::One(device));
    let shutdown = CancellationToken::new();
    let on_signal = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        on_signal.cancel();
    });
    let summary = trainq::run_worker(&pool, &options, shutdown).await?;
    println!("{} step(s) committed, {} abandoned", summary.steps.len(), summary.abandoned);
    Ok(())
}
