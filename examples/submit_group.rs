//! Submit one group of two rollouts from Rust and follow it until the worker has dealt with it.
//!
//! `cargo run --example submit_group -- MODEL` with `DATABASE_URL` set (the model must exist:
//! `trainq model create`). Builds without libtorch too:
//! `cargo run --no-default-features --example submit_group -- MODEL`.

use std::time::Duration;

use serde_json::json;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = std::env::args().nth(1).ok_or("usage: submit_group MODEL")?;
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let pool = sqlx::PgPool::connect(&url).await?;

    let latest = trainq::latest_checkpoint(&pool, &model).await?;
    let policy_version = latest.map_or(trainq::StepNumber::BASE, |c| c.step);
    let group = trainq::NewGroup {
        model: model.clone(),
        trajectories: json!([
            {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], "reward": 1.0},
            {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}], "reward": 0.0},
        ]),
        policy_version: Some(policy_version),
        metadata: json!({"source": "examples/submit_group.rs"}),
    };
    let id = trainq::submit_group(&pool, &group).await?;
    println!("submitted group {id} (sampled from step {policy_version})");

    for _ in 0..30 {
        let status = trainq::group_status(&pool, id).await?.ok_or("the group vanished")?;
        println!("state: {}", status.state);
        if !matches!(status.state.as_str(), "pending" | "claimed") {
            break;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    Ok(())
}
