//! `trainq status [MODEL]` and `trainq steps MODEL`: what the queue holds and what training did.

use anyhow::Result;
use chrono::Utc;
use trainq::report::tokens_per_second;
use trainq_queue::db::{self, QueueCounts, StepRecord};

use crate::database::{block_on, DatabaseArgs};

/// `trainq status [MODEL]`.
#[derive(clap::Args, Debug)]
pub(crate) struct StatusArgs {
    /// Only this model (default: all).
    model: Option<String>,
    #[command(flatten)]
    db: DatabaseArgs,
}

/// `trainq steps MODEL`.
#[derive(clap::Args, Debug)]
pub(crate) struct StepsArgs {
    /// Model name.
    model: String,
    /// Newest steps to show.
    #[arg(long, default_value_t = 20)]
    limit: i64,
    /// Print the full records as JSON lines instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    db: DatabaseArgs,
}

fn skipped_text(counts: &QueueCounts) -> String {
    if counts.skipped.is_empty() {
        return "0".into();
    }
    let parts: Vec<String> = counts.skipped.iter().map(|(reason, n)| format!("{reason}={n}")).collect();
    parts.join(",")
}

fn age_text(seconds: Option<f64>) -> String {
    match seconds {
        None => "-".into(),
        Some(s) if s < 120.0 => format!("{s:.0}s"),
        Some(s) if s < 7200.0 => format!("{:.0}m", s / 60.0),
        Some(s) => format!("{:.1}h", s / 3600.0),
    }
}

/// Prints queue depth per model (with its skipped passes: claims whose groups were all skipped,
/// so no step was taken) and the workers with their last heartbeat.
pub(crate) fn run_status(args: StatusArgs) -> Result<()> {
    block_on(async move {
        let pool = args.db.connect(2).await?;
        let counts = db::queue_counts(&pool, args.model.as_deref()).await?;
        println!(
            "{:<20} {:>6} {:>8} {:>8} {:>8} {:>6}  {:<12} {:>14}  SKIPPED",
            "MODEL", "STEP", "PENDING", "CLAIMED", "TRAINED", "FAILED", "OLDEST", "SKIPPED_PASSES"
        );
        for c in &counts {
            let passes = db::skipped_passes::count_skipped_passes(&pool, &c.model).await?;
            println!(
                "{:<20} {:>6} {:>8} {:>8} {:>8} {:>6}  {:<12} {:>14}  {}",
                c.model,
                c.current_step,
                c.pending,
                c.claimed,
                c.trained,
                c.failed,
                age_text(c.oldest_pending_seconds),
                passes,
                skipped_text(c)
            );
        }
        print_last_steps(&pool, &counts).await?;
        let workers = db::list_workers(&pool, args.model.as_deref()).await?;
        if workers.is_empty() {
            println!("\nno workers registered");
            return Ok(());
        }
        println!("\n{:<28} {:<20} {:<16} {:>10}  DEVICES", "WORKER", "HOST", "MODEL", "HEARTBEAT");
        for w in workers {
            let age = (Utc::now() - w.heartbeat_at).num_milliseconds() as f64 / 1000.0;
            println!(
                "{:<28} {:<20} {:<16} {:>10}  {}",
                w.id,
                w.host,
                w.model.unwrap_or_default(),
                format!("{} ago", age_text(Some(age.max(0.0)))),
                w.devices
            );
        }
        Ok(())
    })
}

/// The newest step of each model: throughput and seconds per phase (the worker's
/// `trainq_tokens_per_second` and `trainq_step_phase_seconds`).
async fn print_last_steps(pool: &sqlx::PgPool, counts: &[QueueCounts]) -> Result<()> {
    let mut lines = Vec::new();
    for c in counts {
        let Some(last) = db::list_steps(pool, &c.model, 1).await?.pop() else { continue };
        let rate = tokens_per_second(&last).map(|r| format!("{r:.0}")).unwrap_or_else(|| "-".into());
        let phases: Vec<String> = last
            .timings
            .as_object()
            .into_iter()
            .flatten()
            .filter_map(|(phase, s)| s.as_f64().map(|s| format!("{phase}={s:.2}")))
            .collect();
        lines.push(format!("{:<20} {:>6} {:>10}  {}", c.model, last.step, rate, phases.join(" ")));
    }
    if !lines.is_empty() {
        println!("\n{:<20} {:>6} {:>10}  PHASES (s)", "MODEL", "LAST", "TOKENS/S");
        lines.iter().for_each(|l| println!("{l}"));
    }
    Ok(())
}

fn opt(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.4}")).unwrap_or_else(|| "-".into())
}

fn step_line(s: &StepRecord) -> String {
    let lag = match (s.policy_lag_min, s.policy_lag_max) {
        (Some(a), Some(b)) => format!("{a}..{b}"),
        _ => "-".into(),
    };
    format!(
        "{:>6} {:<20} {:>5}/{:<5} {:<28} {:>9} {:>9} {:>9} {:>9} {:>6} {:<5} {}",
        s.step,
        s.finished_at.format("%Y-%m-%d %H:%M:%S"),
        s.groups_trained,
        s.groups_claimed,
        s.groups_skipped.to_string(),
        opt(s.reward_mean),
        opt(s.reward_std_mean),
        opt(s.loss),
        opt(s.grad_norm),
        lag,
        s.async_weight_syncing,
        s.checkpoint_uri.as_deref().unwrap_or("-"),
    )
}

/// Prints the newest steps of a model, as a table or JSON lines.
pub(crate) fn run_steps(args: StepsArgs) -> Result<()> {
    block_on(async move {
        let pool = args.db.connect(2).await?;
        db::get_model(&pool, &args.model).await?;
        let steps = db::list_steps(&pool, &args.model, args.limit).await?;
        if args.json {
            for s in &steps {
                println!("{}", serde_json::to_string(s)?);
            }
            return Ok(());
        }
        println!(
            "{:>6} {:<20} {:>11} {:<28} {:>9} {:>9} {:>9} {:>9} {:>6} {:<5} CHECKPOINT",
            "STEP", "FINISHED", "TRAINED", "SKIPPED", "REWARD", "STD_MEAN", "LOSS", "GRADNORM", "LAG", "ASYNC"
        );
        for s in &steps {
            println!("{}", step_line(s));
        }
        Ok(())
    })
}
