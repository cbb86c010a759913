//! `trainq report`: one self-contained HTML page (and an SVG file per chart) of a model's run,
//! drawn from `trainq.steps` and `trainq.skipped_passes`: rewards (of the trained groups, of
//! every claimed group, of the skipped ones, and of the passes where every group was skipped),
//! loss and its parts, KL, clip fraction, importance ratio, grad norm, tokens/s, policy lag,
//! groups trained and skipped by reason, skipped passes, and step time by phase. Long runs are
//! bucketed into at most [`DEFAULT_MAX_POINTS`] points per line with a min–max band, so 10
//! steps and 100,000 steps read the same way.

pub mod chart;
pub mod series;

use std::fmt::Write;

use serde_json::Value;
use trainq_queue::db::{SkippedPass, StepRecord};

pub use chart::{escape, line_chart, Chart};
pub use series::{downsample, Bucket, Series, DEFAULT_MAX_POINTS};

/// The rendered report: the page and each chart as its own SVG file.
#[derive(Debug, Clone)]
pub struct ReportPage {
    /// `index.html`: every chart inlined, no external resources.
    pub html: String,
    /// (file name, SVG document), e.g. ("reward.svg", "<svg …").
    pub charts: Vec<(String, String)>,
}

/// One chart of the report: file stem, title, y-axis label, series, whether y starts at 0.
struct ChartSpec {
    file: &'static str,
    title: &'static str,
    y_label: &'static str,
    series: Vec<Series>,
    y_from_zero: bool,
}

/// The worker's phases in the order a step runs them; other recorded phases follow.
const PHASE_ORDER: [&str; 6] = ["claim", "prepare", "train", "save", "upload", "commit"];

fn number_in(object: &Value, key: &str) -> Option<f64> {
    object.get(key).and_then(Value::as_f64)
}

/// Keys of the objects in `column` across all steps, in order of first appearance.
fn keys_of<'a>(steps: &'a [StepRecord], column: impl Fn(&'a StepRecord) -> &'a Value) -> Vec<String> {
    let mut keys: Vec<String> = Vec::new();
    for step in steps {
        if let Some(object) = column(step).as_object() {
            for key in object.keys() {
                if !keys.contains(key) {
                    keys.push(key.clone());
                }
            }
        }
    }
    keys
}

fn series(name: &str, steps: &[StepRecord], value: impl Fn(&StepRecord) -> Option<f64>) -> Series {
    Series::new(name, steps.iter().map(|s| (s.step.0, value(s))))
}

/// Where a skipped pass sits on the step axis: the step it did not take.
fn pass_step(pass: &SkippedPass) -> i64 {
    pass.current_step.next().get()
}

/// Skipped passes (ascending) folded per step axis position: `value` of the passes at each
/// position combined by `fold` (e.g. their count, or their mean).
fn pass_series(
    name: &str,
    passes: &[SkippedPass],
    value: impl Fn(&SkippedPass) -> Option<f64>,
    fold: fn(&[f64]) -> f64,
) -> Series {
    let mut points: Vec<(i64, Vec<f64>)> = Vec::new();
    for pass in passes {
        let at = pass_step(pass);
        if points.last().is_none_or(|(step, _)| *step != at) {
            points.push((at, Vec::new()));
        }
        if let (Some(v), Some((_, values))) = (value(pass), points.last_mut()) {
            values.push(v);
        }
    }
    Series::new(name, points.into_iter().map(|(step, values)| (step, (!values.is_empty()).then(|| fold(&values)))))
}

fn sum(values: &[f64]) -> f64 {
    values.iter().sum()
}

fn mean(values: &[f64]) -> f64 {
    sum(values) / values.len() as f64
}

/// Tokens per second of training: the step's tokens over its `train` phase, or over the whole
/// step when the phase is not recorded.
pub fn tokens_per_second(s: &StepRecord) -> Option<f64> {
    let seconds = number_in(&s.timings, "train")
        .or_else(|| Some((s.finished_at - s.started_at).num_milliseconds() as f64 / 1000.0))?;
    (seconds > 0.0).then(|| s.tokens as f64 / seconds)
}

fn specs(steps: &[StepRecord], passes: &[SkippedPass]) -> Vec<ChartSpec> {
    let part = |key: &'static str| move |s: &StepRecord| number_in(&s.loss_parts, key);
    let skipped: Vec<Series> = keys_of(steps, |s| &s.groups_skipped)
        .iter()
        .map(|reason| {
            series(&format!("skipped: {reason}"), steps, |s| Some(number_in(&s.groups_skipped, reason).unwrap_or(0.0)))
        })
        .collect();
    let mut groups = vec![series("trained", steps, |s| Some(s.groups_trained as f64))];
    groups.extend(skipped);
    let mut phase_names = keys_of(steps, |s| &s.timings);
    phase_names.sort_by_key(|p| PHASE_ORDER.iter().position(|known| known == p).unwrap_or(PHASE_ORDER.len()));
    let mut phases: Vec<Series> =
        phase_names.iter().map(|phase| series(phase, steps, |s| number_in(&s.timings, phase))).collect();
    phases.push(series("whole step", steps, |s| Some((s.finished_at - s.started_at).num_milliseconds() as f64 / 1e3)));
    let spec = |file, title, y_label, series, y_from_zero| ChartSpec { file, title, y_label, series, y_from_zero };
    vec![
        spec(
            "reward",
            "Reward (mean per trajectory; skipped passes at the step they did not take)",
            "reward",
            vec![
                series("trained groups", steps, |s| s.reward_mean),
                series("all claimed", steps, |s| s.reward_mean_claimed),
                series("skipped groups", steps, |s| s.reward_mean_skipped),
                pass_series("skipped passes", passes, |p| p.reward_mean_claimed, mean),
                series("within-group std", steps, |s| s.reward_std_mean),
            ],
            false,
        ),
        spec(
            "loss",
            "Loss and its parts",
            "loss",
            vec![series("loss", steps, |s| s.loss), series("policy loss", steps, part("policy_loss"))],
            false,
        ),
        spec("kl", "KL to the base model", "KL", vec![series("kl", steps, part("kl"))], true),
        spec(
            "clip_fraction",
            "Clip fraction",
            "fraction of tokens",
            vec![series("clipped", steps, part("clip_fraction"))],
            true,
        ),
        spec(
            "importance_ratio",
            "Importance ratio (policy / sampler)",
            "mean ratio",
            vec![series("mean ratio", steps, part("mean_ratio"))],
            false,
        ),
        spec(
            "grad_norm",
            "Gradient norm (before clipping)",
            "norm",
            vec![series("grad norm", steps, |s| s.grad_norm)],
            true,
        ),
        spec(
            "tokens_per_second",
            "Training throughput",
            "tokens/s",
            vec![series("tokens/s", steps, tokens_per_second)],
            true,
        ),
        spec(
            "policy_lag",
            "Policy lag (current_step − policy_version; current_step = step − 1)",
            "steps",
            vec![
                series("min", steps, |s| s.policy_lag_min.map(|v| v as f64)),
                series("max", steps, |s| s.policy_lag_max.map(|v| v as f64)),
            ],
            true,
        ),
        spec("groups", "Groups per step", "groups", groups, true),
        spec(
            "skipped_passes",
            "Skipped passes (every claimed group skipped, no step taken)",
            "passes",
            vec![
                pass_series("passes", passes, |_| Some(1.0), sum),
                pass_series("groups in them", passes, |p| Some(p.groups_claimed as f64), sum),
            ],
            true,
        ),
        spec("step_time", "Step time by phase", "seconds", phases, true),
        spec("learning_rate", "Learning rate", "lr", vec![series("lr", steps, |s| s.learning_rate)], true),
    ]
}

/// Renders the report of `model` from its steps and its skipped passes (both ascending),
/// drawing at most `max_points` points per line. A skipped pass is drawn at the step it did not
/// take (`current_step + 1`).
pub fn render_report(model: &str, steps: &[StepRecord], passes: &[SkippedPass], max_points: usize) -> ReportPage {
    let at = steps.iter().map(|s| s.step.0).chain(passes.iter().map(pass_step));
    let range = match (at.clone().min(), at.max()) {
        (Some(a), Some(b)) => (a, b),
        _ => (0, 0),
    };
    let charts: Vec<(String, String)> = specs(steps, passes)
        .into_iter()
        .map(|spec| {
            let chart = Chart {
                title: spec.title,
                y_label: spec.y_label,
                series: &spec.series,
                steps: range,
                max_points,
                y_from_zero: spec.y_from_zero,
            };
            (format!("{}.svg", spec.file), line_chart(&chart))
        })
        .collect();
    let html = page(model, steps, passes, &charts, max_points);
    ReportPage { html, charts }
}

fn page(
    model: &str,
    steps: &[StepRecord],
    passes: &[SkippedPass],
    charts: &[(String, String)],
    max_points: usize,
) -> String {
    let mut html = String::new();
    let title = format!("trainq report: {}", escape(model));
    let _ = write!(
        html,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title>\n<style>\
         body{{font-family:sans-serif;margin:24px;color:#222;background:#fafafa}}\
         h1{{font-size:22px;margin:0 0 8px}} p.note{{color:#666;font-size:13px;margin:4px 0 16px}}\
         table{{border-collapse:collapse;font-size:13px;margin-bottom:18px}} td{{padding:3px 14px 3px 0}} td:first-child{{color:#666}}\
         .charts{{display:grid;grid-template-columns:repeat(auto-fill,minmax(720px,1fr));gap:14px}}\
         figure{{margin:0;background:white;border:1px solid #ddd;border-radius:4px;padding:4px}} svg{{width:100%;height:auto}}\
         </style></head><body>\n<h1>{title}</h1>\n"
    );
    summary(&mut html, steps, passes);
    let bucketed = steps.len() > max_points;
    let note = if bucketed {
        format!(
            "{} steps, drawn as {max_points} buckets: each line is the bucket mean, the shaded band its min–max.",
            steps.len()
        )
    } else {
        format!("{} steps, one point each.", steps.len())
    };
    let _ =
        writeln!(html, "<p class=\"note\">{note} Generated {}.</p>", chrono::Utc::now().format("%Y-%m-%d %H:%M UTC"));
    html.push_str("<div class=\"charts\">\n");
    for (file, svg) in charts {
        let _ = writeln!(html, "<figure id=\"{}\">{}</figure>", file.trim_end_matches(".svg"), svg.trim_end());
    }
    html.push_str("</div>\n</body></html>\n");
    html
}

fn summary(html: &mut String, steps: &[StepRecord], passes: &[SkippedPass]) {
    let skipped_passes = skipped_passes_text(passes);
    let (Some(first), Some(last)) = (steps.first(), steps.last()) else {
        html.push_str("<p>No steps recorded yet.</p>\n");
        let _ =
            writeln!(html, "<table>\n<tr><td>skipped passes</td><td>{}</td></tr>\n</table>", escape(&skipped_passes));
        return;
    };
    let trained: i64 = steps.iter().map(|s| s.groups_trained as i64).sum();
    let claimed: i64 = steps.iter().map(|s| s.groups_claimed as i64).sum();
    let tokens: i64 = steps.iter().map(|s| s.tokens).sum();
    let reward = last.reward_mean.map(|r| format!("{r:.4}")).unwrap_or_else(|| "-".into());
    let rows = [
        ("steps", format!("{} – {} ({} recorded)", first.step, last.step, steps.len())),
        (
            "time",
            format!("{} – {}", first.started_at.format("%Y-%m-%d %H:%M"), last.finished_at.format("%Y-%m-%d %H:%M")),
        ),
        ("groups", format!("{trained} trained of {claimed} claimed in steps")),
        ("skipped passes", skipped_passes),
        ("tokens trained", tokens.to_string()),
        ("last reward mean", reward),
        ("async weight syncing", last.async_weight_syncing.to_string()),
        ("latest checkpoint", last.checkpoint_uri.clone().unwrap_or_else(|| "-".into())),
    ];
    html.push_str("<table>\n");
    for (key, value) in rows {
        let _ = writeln!(html, "<tr><td>{key}</td><td>{}</td></tr>", escape(&value));
    }
    html.push_str("</table>\n");
}

/// "3 (24 groups, every one skipped; the last before step 7)", or "none".
fn skipped_passes_text(passes: &[SkippedPass]) -> String {
    let Some(last) = passes.last() else { return "none".into() };
    let groups: i64 = passes.iter().map(|p| p.groups_claimed as i64).sum();
    format!("{} ({groups} groups, every one skipped; the last before step {})", passes.len(), pass_step(last))
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::{TimeDelta, Utc};
    use serde_json::json;
    use trainq_queue::StepNumber;

    fn step(n: i64) -> StepRecord {
        let started = Utc::now();
        StepRecord {
            model: "m".into(),
            step: StepNumber(n),
            worker_id: "w".into(),
            async_weight_syncing: true,
            started_at: started,
            finished_at: started + TimeDelta::seconds(2),
            groups_claimed: 8,
            groups_trained: 6,
            groups_skipped: if n % 2 == 0 {
                json!({"zero_variance": 2})
            } else {
                json!({"stale": 1, "zero_variance": 1})
            },
            trajectories: 48,
            tokens: 1000,
            loss: Some(0.1),
            loss_parts: json!({"policy_loss": 0.1, "kl": 0.01, "clip_fraction": 0.05, "mean_ratio": 1.0}),
            grad_norm: Some(1.0),
            learning_rate: Some(1e-5),
            reward_mean: Some(n as f64 / 10.0),
            reward_std_mean: Some(0.3),
            policy_lag_min: Some(0),
            policy_lag_max: Some(1),
            timings: json!({"claim": 0.1, "train": 1.5, "upload": 0.2}),
            devices: json!(["cuda:0"]),
            checkpoint_uri: Some(format!("s3://b/m/checkpoints/{n:06}/")),
            checkpoint_sha256: None,
            groups_wanted: None,
            reward_mean_claimed: None,
            reward_mean_skipped: None,
            logprob_coverage: None,
            importance_ratio_mean: None,
        }
    }

    #[test]
    fn every_metric_gets_its_chart_and_every_skip_reason_and_phase_a_line() {
        let steps: Vec<StepRecord> = (1..=10).map(step).collect();
        let page = render_report("m <1>", &steps, &[], DEFAULT_MAX_POINTS);
        let files: Vec<&str> = page.charts.iter().map(|(f, _)| f.as_str()).collect();
        for expected in
            ["reward.svg", "loss.svg", "kl.svg", "clip_fraction.svg", "importance_ratio.svg", "grad_norm.svg"]
        {
            assert!(files.contains(&expected), "{files:?}");
        }
        let groups = &page.charts.iter().find(|(f, _)| f == "groups.svg").unwrap().1;
        assert!(groups.contains("skipped: zero_variance") && groups.contains("skipped: stale"));
        let phases = &page.charts.iter().find(|(f, _)| f == "step_time.svg").unwrap().1;
        assert!(phases.contains(">claim<") && phases.contains(">upload<") && phases.contains(">whole step<"));
        assert!(page.html.contains("trainq report: m &lt;1&gt;"));
        assert_eq!(page.html.matches("<svg").count(), page.charts.len());
        assert!(!page.html.contains("<script") && !page.html.contains("src=") && !page.html.contains("href="));
    }

    fn pass(current_step: i64, groups: i32, reward: f64) -> SkippedPass {
        SkippedPass {
            model: "m".into(),
            current_step: StepNumber(current_step),
            worker_id: "w".into(),
            started_at: Utc::now(),
            groups_claimed: groups,
            groups_skipped: json!({"zero_variance": groups}),
            reward_mean_claimed: Some(reward),
            reward_std_mean: Some(0.0),
        }
    }

    /// The points of the `index`-th polyline of `svg` (series are drawn in legend order).
    fn points_of(svg: &str, index: usize) -> Vec<&str> {
        let line = svg.split("<polyline").nth(index + 1).unwrap().split("points=\"").nth(1).unwrap();
        line.split('"').next().unwrap().split(' ').collect()
    }

    #[test]
    fn rewards_of_claimed_and_skipped_groups_and_skipped_passes_are_drawn_beside_the_trained_ones() {
        let mut steps: Vec<StepRecord> = (1..=3).map(step).collect();
        for s in &mut steps {
            (s.reward_mean_claimed, s.reward_mean_skipped) = (Some(0.8), Some(1.0));
        }
        // Two passes before step 4 (after step 3 was committed), one more before step 5.
        let passes = [pass(3, 8, 1.0), pass(3, 4, 0.5), pass(4, 8, 1.0)];
        let page = render_report("m", &steps, &passes, DEFAULT_MAX_POINTS);
        let reward = &page.charts.iter().find(|(f, _)| f == "reward.svg").unwrap().1;
        for name in ["trained groups", "all claimed", "skipped groups", "skipped passes", "within-group std"] {
            assert!(reward.contains(&format!(">{name}<")), "{name} in {reward}");
        }
        assert_eq!(points_of(reward, 1).len(), 3, "claimed-groups mean: one point per step");
        assert_eq!(points_of(reward, 3).len(), 2, "passes: one point per step not taken");
        let chart = &page.charts.iter().find(|(f, _)| f == "skipped_passes.svg").unwrap().1;
        assert!(chart.contains(">passes<") && chart.contains(">groups in them<"));
        assert!(!chart.contains("no data"));
        assert!(page.html.contains("3 (20 groups, every one skipped; the last before step 5)"), "{}", page.html);
        let lag = &page.charts.iter().find(|(f, _)| f == "policy_lag.svg").unwrap().1;
        assert!(lag.contains("current_step − policy_version"), "the documented lag, not step − policy_version");
    }

    #[test]
    fn a_run_of_only_skipped_passes_still_shows_them() {
        let page = render_report("m", &[], &[pass(0, 8, 1.0)], DEFAULT_MAX_POINTS);
        assert!(page.html.contains("No steps recorded yet"));
        assert!(page.html.contains("1 (8 groups, every one skipped; the last before step 1)"));
        let chart = &page.charts.iter().find(|(f, _)| f == "skipped_passes.svg").unwrap().1;
        assert!(!chart.contains("no data"));
    }

    #[test]
    fn tokens_per_second_use_the_train_phase() {
        assert_eq!(tokens_per_second(&step(1)), Some(1000.0 / 1.5));
    }

    #[test]
    fn an_empty_run_still_renders() {
        let page = render_report("m", &[], &[], DEFAULT_MAX_POINTS);
        assert!(page.html.contains("No steps recorded yet") && page.html.contains("skipped passes</td><td>none"));
        assert!(page.charts.iter().all(|(_, svg)| svg.contains("no data")));
    }
}
