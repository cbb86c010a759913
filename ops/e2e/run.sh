#!/usr/bin/env bash
# One end-to-end run of the user's own path, on a machine where ops/e2e/start-services.sh has
# run (PostgreSQL + S3-compatible server; its env file sourced): `trainq migrate`,
# `trainq model create` on MODEL_DIR (an HF directory with the real Qwen3 tokenizer), then
# `trainq worker --store s3://…` and `trainq bench produce` streaming groups side by side until
# the model has STEPS steps; then ops/e2e/report.py summarizes the steps from PostgreSQL.
#
#   ops/e2e/run.sh NAME MODEL_DIR [async|sync]
#
# Env: TRAINQ (binary, default .carry/trainq), STEPS (50), GROUPS_PER_STEP (32),
# GROUP_SIZE (8), DOC_MIN/DOC_MAX (300/6000 tokens), DEVICE (cuda), MAX_TOKENS (micro-batch
# budget, 16384), KEEP_LAST (checkpoints retained, 5), METRICS_ADDR (the worker's Prometheus
# endpoint, off), MAX_STALENESS (async runs, 2), AHEAD (steps' worth of groups the producer keeps
# queued in async runs, 2), OUT (where logs and the report go). Prints the report's JSON last.
set -euo pipefail
cd "$(dirname "$0")/../.."
name=$1 model_dir=$2 mode=${3:-async}
trainq=${TRAINQ:-.carry/trainq}
steps=${STEPS:-50} groups=${GROUPS_PER_STEP:-32} size=${GROUP_SIZE:-8}
out=${OUT:-/tmp/trainq-out}/$name
mkdir -p "$out"
py=${PY:-/opt/torch/.venv/bin/python}
[ -x "$py" ] || py=$(command -v python3)
psql=${TRAINQ_SERVICES_BIN:+$TRAINQ_SERVICES_BIN/}psql

"$trainq" migrate >/dev/null
printf '{"max_seq_len": %d, "max_tokens_per_micro_batch": %d}' "$(( ${DOC_MAX:-6000} + 2048 ))" "${MAX_TOKENS:-16384}" > "$out/config.json"
"$trainq" model create "$name" --base "$model_dir" --lora-rank 8 --config "$out/config.json" \
  --groups-per-step "$groups" --lease-seconds 600 >/dev/null
flags=(--async-weight-syncing --max-staleness "${MAX_STALENESS:-2}")
produce=(--ahead "${AHEAD:-2}")
if [ "$mode" = sync ]; then flags=(); produce=(--sync); fi

"$trainq" worker --model "$name" --store "${STORE:-s3://${TRAINQ_S3_BUCKET:-trainq}/e2e}" --device "${DEVICE:-cuda}" \
  --work-dir "/tmp/trainq-e2e/$name" --max-steps "$steps" --keep-last "${KEEP_LAST:-5}" "${flags[@]}" \
  ${METRICS_ADDR:+--metrics-addr "$METRICS_ADDR"} > "$out/worker.log" 2>&1 &
worker=$!
"$trainq" bench produce --model "$name" --steps "$steps" --groups-per-step "$groups" --group-size "$size" \
  --doc-min "${DOC_MIN:-300}" --doc-max "${DOC_MAX:-6000}" "${produce[@]}" > "$out/produce.log" 2>&1 &
producer=$!
status=0
wait "$worker" || status=$?
kill "$producer" 2>/dev/null || true
wait "$producer" 2>/dev/null || true
[ "$status" = 0 ] || { tail -30 "$out/worker.log"; exit "$status"; }

"$psql" "$DATABASE_URL" -AtF $'\t' -c "COPY (SELECT step, extract(epoch FROM started_at) AS started,
    extract(epoch FROM finished_at) AS finished, groups_claimed, groups_trained, groups_skipped::text AS skipped, tokens,
    (loss_parts->>'real_tokens')::bigint AS real_tokens, loss, timings::text AS timings, policy_lag_min, policy_lag_max,
    async_weight_syncing FROM trainq.steps WHERE model = '$name' ORDER BY step) TO STDOUT WITH (FORMAT csv, HEADER)" > "$out/steps.csv"
"$psql" "$DATABASE_URL" -AtF $'\t' -c "COPY (SELECT state, coalesce(skip_reason::text, '') AS reason, count(*) FROM trainq.groups
    WHERE model = '$name' GROUP BY 1, 2) TO STDOUT WITH (FORMAT csv, HEADER)" > "$out/groups.csv"
"$py" ops/e2e/report.py "$out" | tee "$out/report.json"
