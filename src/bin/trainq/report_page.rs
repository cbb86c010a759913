//! `trainq report MODEL [--out DIR]`: the run's charts (its steps and skipped passes) as one HTML
//! page and SVG files.

use std::path::PathBuf;

use anyhow::{Context, Result};
use trainq::report::{render_report, DEFAULT_MAX_POINTS};
use trainq_queue::db;

use crate::database::{block_on, DatabaseArgs};

/// `trainq report`.
#[derive(clap::Args, Debug)]
pub(crate) struct ReportArgs {
    /// Model name.
    model: String,
    /// Output directory: index.html (self-contained) and one SVG per chart.
    #[arg(long, default_value = "trainq-report")]
    out: PathBuf,
    /// Most points per line; longer runs are bucketed (mean line, min–max band).
    #[arg(long, default_value_t = DEFAULT_MAX_POINTS)]
    max_points: usize,
    #[command(flatten)]
    db: DatabaseArgs,
}

/// Reads every step of the model and writes the report.
pub(crate) fn run(args: ReportArgs) -> Result<()> {
    block_on(async move {
        let pool = args.db.connect(2).await?;
        db::get_model(&pool, &args.model).await?;
        let steps = db::all_steps(&pool, &args.model).await?;
        let mut passes = db::list_skipped_passes(&pool, &args.model, i64::MAX).await?;
        passes.reverse(); // oldest first, like the steps
        let page = render_report(&args.model, &steps, &passes, args.max_points.max(2));
        std::fs::create_dir_all(&args.out).with_context(|| format!("create {}", args.out.display()))?;
        for (file, svg) in &page.charts {
            let path = args.out.join(file);
            std::fs::write(&path, svg).with_context(|| format!("write {}", path.display()))?;
        }
        let index = args.out.join("index.html");
        std::fs::write(&index, &page.html).with_context(|| format!("write {}", index.display()))?;
        println!(
            "{} steps and {} skipped passes of {} → {} ({} charts)",
            steps.len(),
            passes.len(),
            args.model,
            index.display(),
            page.charts.len()
        );
        Ok(())
    })
}
