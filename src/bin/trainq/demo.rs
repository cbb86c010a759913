//! `trainq demo`: the whole loop on this machine with a tiny model and a toy task.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use trainq::demo::run::{run_demo, DemoOptions};

/// Settings of `trainq demo`.
#[derive(Args, Debug)]
pub(crate) struct DemoArgs {
    /// PostgreSQL server URL; the demo (re)creates its own database `trainq_demo` there.
    #[arg(long, env = "DATABASE_URL", default_value = "postgres://postgres@127.0.0.1:5432/postgres")]
    database_url: String,
    /// Directory for the tiny model, the file:// checkpoint store and the plot.
    #[arg(long, default_value = ".trainq/demo")]
    dir: PathBuf,
    /// Training steps.
    #[arg(long, default_value_t = 20)]
    steps: u64,
    /// Groups sampled per step.
    #[arg(long, default_value_t = 8)]
    groups_per_step: usize,
    /// Completions per group.
    #[arg(long, default_value_t = 8)]
    group_size: usize,
    /// Seed for the model's initialization and sampling.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

pub(crate) fn run(args: DemoArgs) -> Result<()> {
    let opts = DemoOptions {
        database_url: args.database_url,
        work_dir: args.dir,
        steps: args.steps,
        groups_per_step: args.groups_per_step,
        group_size: args.group_size,
        seed: args.seed,
    };
    let runtime = tokio::runtime::Runtime::new()?;
    let (rows, plot) = runtime.block_on(run_demo(&opts))?;
    println!("\n| sampled from checkpoint | mean reward | trained into |");
    println!("|---:|---:|---|");
    for r in &rows {
        let step = r.step.map(|s| format!("step {s}")).unwrap_or_else(|| "no step: every group zero variance".into());
        println!("| {} | {:.3} | {step} |", r.policy_version, r.reward_mean);
    }
    let (first, last) = (rows.first().map(|r| r.reward_mean), rows.last().map(|r| r.reward_mean));
    if let (Some(first), Some(last)) = (first, last) {
        println!("\nmean reward went from {first:.3} to {last:.3}; plot: {}", plot.display());
    }
    Ok(())
}
