//! `trainq report` end to end: steps and skipped passes in a real PostgreSQL database become an
//! HTML page and SVG files; a short run draws every step, a long one at most 1,000 buckets per
//! line; the reward chart also draws the claimed and skipped groups' rewards and the skipped
//! passes; and, where Chromium is installed, a headless browser renders the page to a
//! screenshot of the asked size.

mod common;

use std::path::Path;
use std::process::Command;

use common::db::TestDb;

/// Inserts `n` synthetic steps of `model` (rewards rising, two skip reasons, six phases; the
/// claimed groups' reward 0.1 below the trained ones', the skipped groups' at 1).
async fn seed_steps(db: &TestDb, model: &str, n: i64) {
    db.create_model(model).await;
    sqlx::query(
        "INSERT INTO trainq.steps (model, step, worker_id, async_weight_syncing, started_at, finished_at, \
             groups_claimed, groups_trained, groups_skipped, trajectories, tokens, loss, loss_parts, grad_norm, \
             learning_rate, reward_mean, reward_std_mean, policy_lag_min, policy_lag_max, timings, devices, \
             reward_mean_claimed, reward_mean_skipped) \
         SELECT $1, s, 'w', true, now(), now() + interval '8 s', 8, 6, '{\"zero_variance\": 1, \"stale\": 1}', 48, \
             40000, 0.01, jsonb_build_object('policy_loss', 0.01, 'kl', 0.001 * s / $2, 'clip_fraction', 0.05, \
             'mean_ratio', 1.0), 1.0, 1e-5, s::float8 / $2, 0.3, 0, s % 3, \
             '{\"claim\": 0.1, \"prepare\": 0.5, \"train\": 6, \"save\": 0.3, \"upload\": 1, \"commit\": 0.05}', '[]', \
             s::float8 / $2 - 0.1, 1.0 \
         FROM generate_series(1, $2::bigint) s",
    )
    .bind(model)
    .bind(n)
    .execute(&db.pool)
    .await
    .unwrap();
}

/// Inserts skipped passes of `model`: `per_step` of them after each step in `after` (every
/// group zero-variance at reward 1: saturation).
async fn seed_skipped_passes(db: &TestDb, model: &str, after: &[i64], per_step: i64) {
    sqlx::query(
        "INSERT INTO trainq.skipped_passes (model, current_step, worker_id, started_at, groups_claimed, \
             groups_skipped, reward_mean_claimed, reward_std_mean) \
         SELECT $1, s, 'w', now(), 8, '{\"zero_variance\": 8}', 1.0, 0.0 \
         FROM unnest($2::bigint[]) s, generate_series(1, $3::bigint)",
    )
    .bind(model)
    .bind(after)
    .bind(per_step)
    .execute(&db.pool)
    .await
    .unwrap();
}

/// The points of the `index`-th line of an SVG chart (lines are drawn in legend order).
fn line_points(svg: &str, index: usize) -> Vec<String> {
    let line = svg.split("<polyline").nth(index + 1).unwrap().split("points=\"").nth(1).unwrap();
    line.split('"').next().unwrap().split(' ').filter(|p| !p.is_empty()).map(str::to_string).collect()
}

fn report(db: &TestDb, model: &str, out: &Path) {
    let output = Command::new(env!("CARGO_BIN_EXE_trainq"))
        .args(["report", model, "--out", out.to_str().unwrap()])
        .env("DATABASE_URL", db.url(None))
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
}

/// The number of points of the trained groups' reward line (the first `polyline` of reward.svg).
fn reward_line_points(out: &Path) -> usize {
    line_points(&std::fs::read_to_string(out.join("reward.svg")).unwrap(), 0).len()
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
    seed_skipped_passes(&db, "short", &[4, 10], 3).await; // before steps 5 and 11
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
        for chart in ["policy_lag", "groups", "skipped_passes", "step_time"] {
            assert!(out.join(format!("{chart}.svg")).is_file(), "{chart}.svg");
        }
        assert!(!html.contains("<script") && !html.contains("src="), "self-contained");
    }
    assert_eq!(reward_line_points(&short), 10);
    assert_eq!(reward_line_points(&long), 1000);
    // Rewards of every claimed group and of the skipped ones, and the skipped passes at the
    // steps they did not take (5 and 11: the axis grows to include the last one).
    let reward = std::fs::read_to_string(short.join("reward.svg")).unwrap();
    for (index, name, points) in [(1, "all claimed", 10), (2, "skipped groups", 10), (3, "skipped passes", 2)] {
        assert!(reward.contains(&format!(">{name}<")), "{name} in the legend");
        assert_eq!(line_points(&reward, index).len(), points, "{name}");
    }
    let passes = std::fs::read_to_string(short.join("skipped_passes.svg")).unwrap();
    assert_eq!(line_points(&passes, 0).len(), 2, "one point per step not taken");
    let html = std::fs::read_to_string(short.join("index.html")).unwrap();
    assert!(html.contains("6 (48 groups, every one skipped; the last before step 11)"), "summary row");
    let lag = std::fs::read_to_string(short.join("policy_lag.svg")).unwrap();
    assert!(lag.contains("current_step − policy_version"), "the lag as documented");
    let groups = std::fs::read_to_string(long.join("groups.svg")).unwrap();
    assert!(groups.contains("skipped: zero_variance") && groups.contains("skipped: stale"));
    assert!(std::fs::read_to_string(long.join("index.html")).unwrap().contains("drawn as 1000 buckets"));

    let Some(chromium) =
        ["chromium", "chromium-browser"].into_iter().find(|c| Command::new(c).arg("--version").output().is_ok())
    else {
        // ops/setup.sh installs it; skipping needs saying so.
        assert!(
            std::env::var_os("TRAINQ_SKIP_BROWSER_CHECK").is_some(),
            "no chromium on PATH for the browser check: run ops/setup.sh (apt-get install chromium), \
             or set TRAINQ_SKIP_BROWSER_CHECK=1 to skip it"
        );
        eprintln!("TRAINQ_SKIP_BROWSER_CHECK is set: the browser check is skipped");
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
