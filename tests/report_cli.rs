//! `trainq report` end to end: steps in a real PostgreSQL database become an HTML page and SVG
//! files; a short run draws every step, a long one at most 1,000 buckets per line; and, where
//! Chromium is installed, a headless browser renders the page to a screenshot of the asked size.

mod common;

use std::path::Path;
use std::process::Command;

use common::db::TestDb;

/// Inserts `n` synthetic steps of `model` (rewards rising, two skip reasons, six phases).
async fn seed_steps(db: &TestDb, model: &str, n: i64) {
    db.create_model(model).await;
    sqlx::query(
        "INSERT INTO trainq.steps (model, step, worker_id, async_weight_syncing, started_at, finished_at, \
             groups_claimed, groups_trained, groups_skipped, trajectories, tokens, loss, loss_parts, grad_norm, \
             learning_rate, reward_mean, reward_std_mean, policy_lag_min, policy_lag_max, timings, devices) \
         SELECT $1, s, 'w', true, now(), now() + interval '8 s', 8, 6, '{\"zero_variance\": 1, \"stale\": 1}', 48, \
             40000, 0.01, jsonb_build_object('policy_loss', 0.01, 'kl', 0.001 * s / $2, 'clip_fraction', 0.05, \
             'mean_ratio', 1.0), 1.0, 1e-5, s::float8 / $2, 0.3, 0, s % 3, \
             '{\"claim\": 0.1, \"prepare\": 0.5, \"train\": 6, \"save\": 0.3, \"upload\": 1, \"commit\": 0.05}', '[]' \
         FROM generate_series(1, $2::bigint) s",
    )
    .bind(model)
    .bind(n)
    .execute(&db.pool)
    .await
    .unwrap();
}

fn report(db: &TestDb, model: &str, out: &Path) {
    let output = Command::new(env!("CARGO_BIN_EXE_trainq"))
        .args(["report", model, "--out", out.to_str().unwrap()])
        .env("DATABASE_URL", db.url(None))
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
}

/// The number of points of the reward mean line (the first `polyline` of reward.svg).
fn reward_line_points(out: &Path) -> usize {
    let svg = std::fs::read_to_string(out.join("reward.svg")).unwrap();
    let line = svg.split("<polyline").nth(1).unwrap().split("points=\"").nth(1).unwrap();
    line.split('"').next().unwrap().split(' ').count()
}

/// Width and height of a PNG, from its IHDR chunk.
fn png_size(path: &Path) -> (u32, u32) {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(&bytes[1..4], b"PNG", "{} is not a PNG", path.display());
    let be = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
    (be(16), be(20))
}

#[tokio::test]
async fn a_short_and_a_long_run_render_as_html_and_svg_that_a_browser_draws() {
    let db = TestDb::new().await;
    let work = tempfile::tempdir().unwrap();
    seed_steps(&db, "short", 10).await;
    seed_steps(&db, "long", 20_000).await;
    let (short, long) = (work.path().join("short"), work.path().join("long"));
    report(&db, "short", &short);
    report(&db, "long", &long);

    for out in [&short, &long] {
        let html = std::fs::read_to_string(out.join("index.html")).unwrap();
        for chart in ["reward", "loss", "kl", "clip_fraction", "importance_ratio", "grad_norm", "tokens_per_second"] {
            assert!(out.join(format!("{chart}.svg")).is_file(), "{chart}.svg");
            assert!(html.contains(&format!("<figure id=\"{chart}\"><svg")), "{chart} inlined");
        }
        for chart in ["policy_lag", "groups", "step_time"] {
            assert!(out.join(format!("{chart}.svg")).is_file(), "{chart}.svg");
        }
        assert!(!html.contains("<script") && !html.contains("src="), "self-contained");
    }
    assert_eq!(reward_line_points(&short), 10);
    assert_eq!(reward_line_points(&long), 1000);
    let groups = std::fs::read_to_string(long.join("groups.svg")).unwrap();
    assert!(groups.contains("skipped: zero_variance") && groups.contains("skipped: stale"));
    assert!(std::fs::read_to_string(long.join("index.html")).unwrap().contains("drawn as 1000 buckets"));

    let Some(chromium) =
        ["chromium", "chromium-browser"].into_iter().find(|c| Command::new(c).arg("--version").output().is_ok())
    else {
        eprintln!("no chromium on PATH: the browser check is skipped (ops/report-screenshot.sh does it too)");
        return;
    };
    let profile = tempfile::tempdir().unwrap();
    let shot = work.path().join("long.png");
    let status = Command::new(chromium)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        .args(["--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1520,2350"])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(format!("--screenshot={}", shot.display()))
        .arg(format!("file://{}", long.join("index.html").display()))
        .output()
        .unwrap();
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    assert_eq!(png_size(&shot), (1520, 2350));
    let bytes = std::fs::metadata(&shot).unwrap().len();
    assert!(bytes > 50_000, "a page of charts is not a blank {bytes}-byte screenshot");
}
