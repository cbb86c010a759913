#!/usr/bin/env bash
# Checkpoint upload throughput to a local S3 server (moto 5.2.5): trainq's uploader
# (examples/upload_bench.rs, default UploadOptions) next to boto3 `upload_file` (default
# TransferConfig) and `aws s3 cp --recursive` (awscli defaults), for the same files. Each client
# gets a fresh moto per round, so no run pays for another's stored objects.
#
# usage: ops/bench/upload_bench.sh [SHARD_MIB=160] [ROUNDS=3]
#   The checkpoint-like directory holds 3 safetensors shards of SHARD_MIB each, a 10 MiB
#   optimizer file and small JSON files. Results: one JSON line per run on stdout, then medians.
# Needs: $TRAINQ_PYTHON (venv with boto3 + moto), $TRAINQ_MOTO, `aws` on PATH (optional), curl.
# BENCH_BIN=path uses a prebuilt examples/upload_bench instead of building it (BENCH_PROFILE
# picks the cargo profile otherwise, default dev: dependencies are built at opt-level 2).
# BENCH_CLIENTS="trainq boto3" restricts the clients. BENCH_S3S_FS: see start_moto.
set -euo pipefail
cd "$(dirname "$0")/../.."
shard_mib=${1:-160}
rounds=${2:-3}
profile=${BENCH_PROFILE:-dev}
: "${TRAINQ_PYTHON:?source ~/.cache/trainq/env.sh first}" "${TRAINQ_MOTO:?}"

bench_bin=${BENCH_BIN:-}
if [ -z "$bench_bin" ]; then
  cargo build --quiet --profile "$profile" --example upload_bench
  target_dir=$( [ "$profile" = dev ] && echo debug || echo "$profile" )
  bench_bin=target/$target_dir/examples/upload_bench
fi

work=$(mktemp -d)
moto_pid=
cleanup() { [ -n "$moto_pid" ] && kill "$moto_pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

ckpt=$work/ckpt
mkdir -p "$ckpt/training_state"
for i in 1 2 3; do
  head -c "$((shard_mib * 1024 * 1024))" /dev/urandom > "$ckpt/model-0000$i-of-00003.safetensors"
done
head -c $((10 * 1024 * 1024)) /dev/urandom > "$ckpt/training_state/optimizer.safetensors"
for f in config.json generation_config.json model.safetensors.index.json; do
  head -c 4096 /dev/urandom | base64 > "$ckpt/$f"
done
echo "# directory: $(find "$ckpt" -type f -printf '%s\n' | awk '{s += $1} END {print s}') bytes in $(find "$ckpt" -type f | wc -l) files" >&2

port=$("$TRAINQ_PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
endpoint=http://127.0.0.1:$port

# BENCH_S3S_FS=path/to/s3s-fs uses that native S3 server (objects on disk under $work) instead
# of moto, to see the clients when the server is not the bottleneck.
start_moto() {
  if [ -n "${BENCH_S3S_FS:-}" ]; then
    rm -rf "$work/s3" && mkdir -p "$work/s3/bench"
    "$BENCH_S3S_FS" --host 127.0.0.1 --port "$port" --access-key test --secret-key test "$work/s3" \
      >/dev/null 2>&1 &
  else
    "$TRAINQ_MOTO" -H 127.0.0.1 -p "$port" >/dev/null 2>&1 &
  fi
  moto_pid=$!
  for _ in $(seq 1 600); do
    curl -s -o /dev/null "$endpoint/" && break
    sleep 0.1
  done
  [ -n "${BENCH_S3S_FS:-}" ] || curl -sf -X PUT "$endpoint/bench" >/dev/null
}

stop_moto() { kill "$moto_pid"; wait "$moto_pid" 2>/dev/null || true; moto_pid=; }

run_awscli() {
  local bytes started seconds
  bytes=$(find "$ckpt" -type f -printf '%s\n' | awk '{s += $1} END {print s}')
  started=$(date +%s.%N)
  AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test AWS_DEFAULT_REGION=us-east-1 \
    aws --endpoint-url "$endpoint" s3 cp --recursive --quiet "$ckpt" "s3://bench/run/bench/checkpoints/000001/"
  awk -v b="$bytes" -v s="$started" -v e="$(date +%s.%N)" 'BEGIN {
    printf "{\"client\": \"awscli\", \"bytes\": %d, \"seconds\": %.3f, \"mb_per_s\": %.1f}\n", b, e - s, b / 1e6 / (e - s) }'
}

run_client() {
  case $1 in
    trainq) "$bench_bin" "$endpoint" bench run "$ckpt" ;;
    boto3) "$TRAINQ_PYTHON" ops/bench/upload_bench_boto3.py "$endpoint" bench run "$ckpt" ;;
    awscli) run_awscli ;;
  esac
}

# One JSON line per run: the client's line plus the CPU seconds (user + sys) the client process
# spent (start-up included) and the moto server spent serving it (its start-up excluded).
results=$work/results.jsonl
clients=(${BENCH_CLIENTS:-trainq boto3})
command -v aws >/dev/null && [ -z "${BENCH_CLIENTS:-}" ] && clients+=(awscli)
ticks=$(getconf CLK_TCK)
TIMEFORMAT='%U %S'
for round in $(seq 1 "$rounds"); do
  for client in "${clients[@]}"; do
    start_moto
    server_idle=$(awk -v t="$ticks" '{print ($14 + $15) / t}' "/proc/$moto_pid/stat")
    { time run_client "$client" >"$work/line.json" 2>"$work/client.err"; } 2>"$work/cpu.txt" \
      || { cat "$work/client.err" >&2; exit 1; }
    server_cpu=$(awk -v t="$ticks" -v idle="$server_idle" '{print ($14 + $15) / t - idle}' "/proc/$moto_pid/stat")
    stop_moto
    "$TRAINQ_PYTHON" - "$work/line.json" "$work/cpu.txt" "$server_cpu" <<'PY' | tee -a "$results"
import json, sys
run = json.load(open(sys.argv[1]))
user, system = map(float, open(sys.argv[2]).read().split()[-2:])
run["client_cpu_s"], run["server_cpu_s"] = round(user + system, 2), round(float(sys.argv[3]), 2)
print(json.dumps(run))
PY
  done
done

"$TRAINQ_PYTHON" - "$results" <<'PY'
import json, statistics, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
clients = list(dict.fromkeys(r["client"] for r in runs))
def median(client, field, per_gb=False):
    values = [r[field] / (r["bytes"] / 1e9 if per_gb else 1) for r in runs if r["client"] == client]
    return statistics.median(values)
for client in clients:
    rate = median(client, "mb_per_s")
    ratio = f", trainq/{client} {median('trainq', 'mb_per_s') / rate:.2f}x" if "trainq" in clients else ""
    print(f"# median {client}: {rate:.1f} MB/s{ratio}; client CPU {median(client, 'client_cpu_s', True):.2f} s/GB,"
          f" server CPU {median(client, 'server_cpu_s', True):.2f} s/GB")
PY
