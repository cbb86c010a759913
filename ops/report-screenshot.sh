#!/usr/bin/env bash
# Renders `trainq report` for synthetic runs and screenshots each page in headless Chromium, so
# a person (or a reviewer) can look at the charts as a browser draws them, not as strings.
#
#   ops/report-screenshot.sh [STEPS ...]        (default: 10 100000)
#
# For each STEPS it seeds model `report_STEPS` with that many steps in a database of its own
# (`trainq_report_screenshot` on $DATABASE_URL's server, recreated), runs
# `trainq report report_STEPS --out .trainq/report-STEPS`, and writes
# `.trainq/report-STEPS/screenshot.png`. Needs `chromium` (apt-get install -y chromium) and a
# built `trainq` ($TRAINQ_BIN, default: cargo build --no-default-features, no libtorch needed).
set -euo pipefail
cd "$(dirname "$0")/.."
steps_list=("$@")
[ ${#steps_list[@]} -gt 0 ] || steps_list=(10 100000)
server=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
database=trainq_report_screenshot
url="${server%/*}/$database"
if [ -z "${TRAINQ_BIN:-}" ]; then
    env -u LIBTORCH cargo build --quiet --no-default-features --bin trainq
    TRAINQ_BIN="${CARGO_TARGET_DIR:-target}/debug/trainq"
fi
chromium=$(command -v chromium || command -v chromium-browser) || { echo "install chromium first" >&2; exit 1; }

psql -q "$server" -c "DROP DATABASE IF EXISTS $database WITH (FORCE)" -c "CREATE DATABASE $database"
DATABASE_URL=$url "$TRAINQ_BIN" migrate >/dev/null

for n in "${steps_list[@]}"; do
    model="report_$n"
    DATABASE_URL=$url "$TRAINQ_BIN" model create "$model" --base /models/base >/dev/null
    # A run whose reward rises and whose within-group spread shrinks, with noise in every metric.
    psql -q "$url" -v ON_ERROR_STOP=1 <<SQL
INSERT INTO trainq.steps (model, step, worker_id, async_weight_syncing, started_at, finished_at,
    groups_claimed, groups_trained, groups_skipped, trajectories, tokens, loss, loss_parts, grad_norm,
    learning_rate, reward_mean, reward_std_mean, policy_lag_min, policy_lag_max, timings, devices, checkpoint_uri)
SELECT '$model', s, 'gpu-box:1', true,
       t0 + s * interval '10 s', t0 + s * interval '10 s' + make_interval(secs => 7.5 + r1),
       8, 8 - z - st, jsonb_build_object('zero_variance', z, 'stale', st), (8 - z - st) * 8,
       40000 + (r2 * 8000)::int,
       0.02 * exp(-3 * x) + 0.04 * (r3 - 0.5),
       jsonb_build_object('policy_loss', 0.02 * exp(-3 * x) + 0.04 * (r3 - 0.5) - 0.001,
                          'kl', 0.002 + 0.04 * x + 0.004 * r4,
                          'clip_fraction', 0.01 + 0.12 * r5 * exp(-2 * x),
                          'mean_ratio', 1 + 0.03 * (r6 - 0.5), 'micro_batches', 4),
       0.4 + 2 * exp(-4 * x) + 0.3 * r4, 1e-5,
       least(1.0, 0.15 + 0.75 * (1 - exp(-5 * x)) + 0.1 * (r1 - 0.5)),
       0.05 + 0.3 * exp(-3 * x) + 0.03 * r2,
       0, (r6 * 2)::int,
       jsonb_build_object('claim', 0.02 + 0.02 * r2, 'prepare', 0.4 + 0.2 * r3, 'train', 5.5 + r1,
                          'save', 0.3, 'upload', 0.8 + 0.6 * r5, 'commit', 0.03),
       '["cuda:0"]', format('s3://bucket/runs/%s/checkpoints/%s/', '$model', lpad(s::text, 6, '0'))
FROM (SELECT s, s::float8 / $n AS x, now() - $n * interval '10 s' AS t0,
             (random() * 2.6)::int AS z, (random() * 1.3)::int AS st,
             random() AS r1, random() AS r2, random() AS r3, random() AS r4, random() AS r5, random() AS r6
      FROM generate_series(1, $n) s) g;
UPDATE trainq.models SET current_step = $n WHERE name = '$model';
SQL
    out=".trainq/report-$n"
    DATABASE_URL=$url "$TRAINQ_BIN" report "$model" --out "$out"
    profile=$(mktemp -d)
    "$chromium" --headless --no-sandbox --disable-gpu --disable-background-networking \
        --disable-component-update --disable-sync --no-first-run --hide-scrollbars \
        --user-data-dir="$profile" --window-size=1520,2350 \
        --screenshot="$PWD/$out/screenshot.png" "file://$PWD/$out/index.html" 2>/dev/null
    rm -rf "$profile"
    test -s "$out/screenshot.png"
    echo "$out/screenshot.png"
done
