//! `trainq submit FILE.jsonl`: one group per line; good lines go in, bad ones are reported with
//! their line number and the database's SQLSTATE and message.

use std::io::BufRead;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use sqlx::PgPool;
use trainq_queue::db::{self, sqlstate, NewGroup};

use crate::database::{block_on, DatabaseArgs};

/// Groups submitted at once.
const SUBMIT_CONCURRENCY: usize = 8;

/// `trainq submit FILE.jsonl [--model NAME]`.
#[derive(clap::Args, Debug)]
pub(crate) struct SubmitArgs {
    /// JSON Lines file ("-" for stdin). Each line is a group object {"model", "trajectories",
    /// "policy_version", "metadata"}; with --model a line may omit "model" or be just the
    /// trajectories array.
    file: PathBuf,
    /// Model for lines that do not name one.
    #[arg(long)]
    model: Option<String>,
    /// Hide the progress bar.
    #[arg(long)]
    quiet: bool,
    #[command(flatten)]
    db: DatabaseArgs,
}

/// Turns one JSONL line into a group, filling in `default_model`.
fn parse_line(line: &str, default_model: Option<&str>) -> Result<NewGroup> {
    let mut value: serde_json::Value = serde_json::from_str(line).context("not valid JSON")?;
    if value.is_array() {
        value = serde_json::json!({ "trajectories": value });
    }
    let obj = value.as_object_mut().context("a line must be a JSON object (or, with --model, an array)")?;
    if !obj.contains_key("model") {
        let model = default_model.context("the line has no \"model\" and no --model was given")?;
        obj.insert("model".into(), model.into());
    }
    serde_json::from_value(value).context("not a group object")
}

/// One line's failure as `[SQLSTATE] message` when it came from the database.
fn describe(err: &anyhow::Error) -> String {
    if let Some(trainq_queue::Error::Database { source, .. }) = err.downcast_ref::<trainq_queue::Error>() {
        if let (Some(code), Some(db_err)) = (sqlstate::code_of(source), source.as_database_error()) {
            return format!("[{code}] {}", db_err.message());
        }
    }
    format!("{err:#}")
}

async fn submit_line(pool: &PgPool, line: &str, model: Option<&str>) -> Result<()> {
    let group = parse_line(line, model)?;
    db::submit_group(pool, &group).await?;
    Ok(())
}

fn read_lines(file: &PathBuf) -> Result<Vec<(usize, String)>> {
    let reader: Box<dyn BufRead> = if file.as_os_str() == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        let f = std::fs::File::open(file).with_context(|| format!("open {}", file.display()))?;
        Box::new(std::io::BufReader::new(f))
    };
    let mut lines = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line.with_context(|| format!("read {} line {}", file.display(), i + 1))?;
        if !line.trim().is_empty() {
            lines.push((i + 1, line));
        }
    }
    Ok(lines)
}

/// Submits every line; fails (after submitting the good ones) when any line failed.
pub(crate) fn run(args: SubmitArgs) -> Result<()> {
    block_on(async move {
        let lines = read_lines(&args.file)?;
        let pool = args.db.connect(SUBMIT_CONCURRENCY as u32).await?;
        let bar = if args.quiet { ProgressBar::hidden() } else { ProgressBar::new(lines.len() as u64) };
        bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} groups {per_sec} {msg}")?);
        let model = args.model.as_deref();
        let mut results = futures::stream::iter(lines.iter())
            .map(|(n, line)| {
                let pool = &pool;
                async move { (*n, submit_line(pool, line, model).await) }
            })
            .buffer_unordered(SUBMIT_CONCURRENCY);
        let mut failures = Vec::new();
        while let Some((n, result)) = results.next().await {
            bar.inc(1);
            if let Err(err) = result {
                failures.push((n, describe(&err)));
            }
        }
        bar.finish_and_clear();
        failures.sort();
        for (n, why) in &failures {
            eprintln!("{}:{n}: {why}", args.file.display());
        }
        let ok = lines.len() - failures.len();
        println!("submitted {ok} of {} groups", lines.len());
        if !failures.is_empty() {
            bail!("{} of {} lines failed", failures.len(), lines.len());
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_may_be_a_full_group_or_with_model_given_an_object_or_array() {
        let g = parse_line(r#"{"model": "a", "trajectories": [], "policy_version": 2}"#, Some("b")).unwrap();
        assert_eq!((g.model.as_str(), g.policy_version), ("a", Some(trainq_queue::StepNumber(2))));
        let g = parse_line(r#"{"trajectories": [1], "metadata": {"k": 1}}"#, Some("b")).unwrap();
        assert_eq!((g.model.as_str(), g.metadata["k"].as_i64()), ("b", Some(1)));
        let g = parse_line(r#"[{"reward": 1}]"#, Some("b")).unwrap();
        assert_eq!(g.trajectories, serde_json::json!([{"reward": 1}]));
    }

    #[test]
    fn bad_lines_say_what_is_wrong() {
        assert!(format!("{:#}", parse_line("{", None).unwrap_err()).contains("not valid JSON"));
        assert!(format!("{:#}", parse_line(r#"{"trajectories": []}"#, None).unwrap_err()).contains("no \"model\""));
        assert!(format!("{:#}", parse_line(r#"{"model": "a", "trajectories": [], "x": 1}"#, None).unwrap_err())
            .contains("unknown field `x`"));
    }
}
