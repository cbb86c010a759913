#!/usr/bin/env bash
# Builds trainq for the lent H200 machine and runs GPU work there, the same way every session.
#
#   ops/gpu.sh build          # here: release build against torch 2.11, stripped, into .carry/
#   then, through the device tool's `run` with carry [".carry"]:
#   bash ops/gpu.sh bench     # there: trainq's benchmark and the HF+PEFT peer, same shapes, one call
#   bash ops/gpu.sh check     # there: bf16-on-CUDA vs f32-on-CPU agreement and a smoke step
#   bash ops/gpu.sh train ARGS  # there: one `trainq bench train ARGS` row (e.g. --shape qwen3-8b
#                             # --seq 32768 --micro 1 --ckpt); `peer ARGS`: one peer row
#   bash ops/gpu.sh profile [ARGS]  # there: one step of `trainq bench train ARGS` under Nsight
#                             # Compute (kernel durations only), summed by kernel family and name
#   bash ops/gpu.sh trace ARGS  # there: one `trainq bench train ARGS` row plus one step traced by
#                             # libtorch's profiler (ARGS may add --trace-ops: kernels summed by
#                             # the operator that launched them; --trace-steps N: N steps in a
#                             # row); appends the row to trainq.jsonl and the
#                             # trace's summary (ops/bench/trace_summary.py) to profile.md; the
#                             # traces go to $OUT/traces.tar.xz at the end of each call of the verb
#   bash ops/gpu.sh wide      # there: shapes beyond the standard table (4B, 1.7B full, 8B without
#                             # checkpointing, other batch shapes), each trainq then the peer, and
#                             # the ratio table; ROWS="shape mode seq micro ckpt(0|1)" lines override
#   bash ops/gpu.sh packed [ARGS]   # there: packed agent-like documents vs unpacked rows of the same
#                             # token count (trainq), and the peer padded per trajectory, at
#                             # 1×16384 and 4×4096 (ARGS go to both, e.g. --shape/--mode)
#   bash ops/gpu.sh big [ARGS]  # there: Qwen3-32B-shaped LoRA, checkpointed, with and without
#                             # activation offloading, the longest offloaded rows (SEQS), and the
#                             # peer with gradient checkpointing at 1×8192 (H200: 65 GiB weights)
#   bash ops/gpu.sh build-base [REV]  # here: `trainq` at commit REV (default HEAD: the tree without
#                             # uncommitted changes) into .carry/trainq-base, for `ab`; with
#                             # BASE_PATCH=FILE, REV with that diff applied (a patch tried and
#                             # kept aside, e.g. ops/bench/runs/2026-12-06-part8/norm-room-tried.diff)
#   bash ops/gpu.sh ab [ARGS] # there: same-call A/B — per row of ROWS (one line of `bench train`
#                             # args each), .carry/trainq-base then .carry/trainq, twice over; the
#                             # rows go to ab.jsonl tagged "binary", the table to ab.md; AB_TRACE=1
#                             # also traces one step of each (summaries in traces.md);
#                             # AB_BASE_ENV / AB_NEW_ENV ("VAR=value …") set the environment of
#                             # each side, AB_BASE_BIN picks the base binary (e.g. AB_BASE_BIN=trainq
#                             # AB_NEW_ENV=PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: an
#                             # allocator setting A/B'd on one binary)
#   bash ops/gpu.sh e2e       # there: the user's path end to end — carried PostgreSQL and S3 server,
#                             # `trainq migrate`, `model create` on a random Qwen3-0.6B with the real
#                             # tokenizer, `trainq worker --device cuda --store s3://…` while
#                             # `trainq bench produce` streams groups; E2E_MODES="async sync",
#                             # STEPS, GROUPS_PER_STEP, GROUP_SIZE, KEEP_LAST as in ops/e2e/run.sh;
#                             # PEFT_CHECK=1 then loads every committed checkpoint in peft and
#                             # compares its log-probs with `trainq score` (ops/e2e/peft_check.py;
#                             # PEFT_CHECK_DTYPE=f32 for the check that tells adapters apart)
#
# Results are JSON lines under $OUT (trainq.jsonl, peer.jsonl) plus a printed ratio table.
set -euo pipefail
cd "$(dirname "$0")/.."

gpu_torch=/opt/torch/.venv/lib/python3.12/site-packages/torch
gpu_python=/opt/torch/.venv/bin/python

device_env() {
  export NCCL_NVLS_ENABLE=0
  # cudarc looks for libnccl.so; the pip wheel ships libnccl.so.2 only.
  mkdir -p /tmp/trainq-lib
  ln -sf "$gpu_torch/../nvidia/nccl/lib/libnccl.so.2" /tmp/trainq-lib/libnccl.so
  # libnvrtc.so.13 (the fused AdamW kernel is compiled at run time) lives in pip's nvidia/cu13.
  export LD_LIBRARY_PATH=$gpu_torch/lib:$gpu_torch/../nvidia/cu13/lib:/tmp/trainq-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export OUT=${OUT:-/tmp/trainq-out}
  mkdir -p "$OUT"
}

case "${1:-}" in
  build)
    env_file=$(bash ops/setup.sh)
    # shellcheck disable=SC1090
    source "$env_file"
    cargo build --release --locked --bin trainq
    mkdir -p .carry
    cp target/release/trainq .carry/trainq
    # The peer: ops/bench's copy of ../shared/bench/hf_peft_train.py (adds --docs).
    cp ops/bench/hf_peft_train.py .carry/
    bash ops/e2e/pack-services.sh >&2
    ls -la .carry
    ;;
  build-base)
    # A worktree of REV built into the same target directory: third-party crates are shared, only
    # the workspace's own crates compile again. The current tree's binary is linked again at the
    # end (cargo would not copy a fresh artifact back over target/release/trainq), and its C++
    # shim compiled again (REV's build script wrote its own into the shared build directory).
    rev=$(git rev-parse "${2:-HEAD}")
    env_file=$(bash ops/setup.sh)
    # shellcheck disable=SC1090
    source "$env_file"
    tree=/tmp/trainq-base-tree
    git worktree remove --force "$tree" 2>/dev/null || true
    git worktree add --detach "$tree" "$rev" >&2
    if [ -n "${BASE_PATCH:-}" ]; then
      git -C "$tree" apply "$(realpath "$BASE_PATCH")"
    fi
    CARGO_TARGET_DIR=$PWD/target cargo build --release --locked --bin trainq --manifest-path "$tree/Cargo.toml"
    mkdir -p .carry
    cp target/release/trainq .carry/trainq-base
    git worktree remove --force "$tree"
    touch src/bin/trainq/main.rs crates/trainq-engine/csrc/*
    cargo build --release --locked --bin trainq
    echo "$rev${BASE_PATCH:+ + $BASE_PATCH}" > .carry/trainq-base.rev
    ls -la .carry
    ;;
  ab)
    device_env
    shift
    # One side of the A/B: "trainq-base" runs AB_BASE_BIN (default trainq-base) with AB_BASE_ENV,
    # "trainq" runs trainq with AB_NEW_ENV.
    ab_side() {
      local side=$1
      shift
      if [ "$side" = trainq-base ]; then
        # shellcheck disable=SC2086
        env ${AB_BASE_ENV:-} "./.carry/${AB_BASE_BIN:-trainq-base}" "$@"
      else
        # shellcheck disable=SC2086
        env ${AB_NEW_ENV:-} ./.carry/trainq "$@"
      fi
    }
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    default_rows="--mode lora
--mode full
--shape qwen3-1.7b --mode lora"
    while read -r row; do
      [ -n "$row" ] || continue
      for round in 1 2; do
        for side in trainq-base trainq; do
          # shellcheck disable=SC2086
          ab_side $side bench train --skip-peak $row "$@" | sed "s/^{\"impl\"/{\"binary\":\"$side\",\"round\":$round,\"impl\"/" \
            | tee -a "$OUT/ab.jsonl" || true
        done
      done
      if [ -n "${AB_TRACE:-}" ]; then
        # One traced step per side: kernel times side by side in traces.md.
        for side in trainq-base trainq; do
          rm -rf "/tmp/ab-trace-$side" && mkdir -p "/tmp/ab-trace-$side"
          # shellcheck disable=SC2086
          ab_side $side bench train --skip-peak --trace "/tmp/ab-trace-$side" $row "$@" >/dev/null || true
          for t in "/tmp/ab-trace-$side"/*.json; do
            { echo "## $side: $row"; "$gpu_python" ops/bench/trace_summary.py "$t" 40; echo; } >> "$OUT/traces.md"
          done
        done
      fi
    done <<<"${ROWS:-$default_rows}"
    "$gpu_python" ops/bench/ab_table.py "$OUT/ab.jsonl" | tee "$OUT/ab.md"
    ;;
  bench)
    device_env
    shift
    nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
    ./.carry/trainq bench train --all "$@" | tee "$OUT/trainq.jsonl"
    "$gpu_python" .carry/hf_peft_train.py --all | tee "$OUT/peer.jsonl"
    "$gpu_python" ops/bench/compare.py "$OUT/trainq.jsonl" "$OUT/peer.jsonl" | tee "$OUT/table.md"
    ;;
  train)
    # One `trainq bench train ARGS` row (any shape, batch, --packed, --ckpt, --offload).
    device_env
    shift
    ./.carry/trainq bench train "$@" | tee -a "$OUT/trainq.jsonl"
    ;;
  trace)
    device_env
    shift
    mkdir -p /tmp/trainq-traces
    before=$(ls /tmp/trainq-traces | wc -l)
    ./.carry/trainq bench train --trace /tmp/trainq-traces "$@" | tee -a "$OUT/trainq.jsonl"
    for t in $(ls -t /tmp/trainq-traces/*.json | head -$(( $(ls /tmp/trainq-traces | wc -l) - before ))); do
      { echo "args: $*"; "$gpu_python" ops/bench/trace_summary.py "$t" 40; echo; } | tee -a "$OUT/profile.md"
    done
    tar cf - -C /tmp trainq-traces | xz -T0 -6 > "$OUT/traces.tar.xz"
    ;;
  wide)
    device_env
    shift
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    default_rows="qwen3-4b lora 4096 4 0
qwen3-1.7b full 4096 4 0
qwen3-8b lora 4096 2 0
qwen3-0.6b lora 16384 1 0
qwen3-0.6b lora 2048 8 0
qwen3-1.7b lora 8192 2 0
qwen3-4b full 4096 2 1"
    while read -r shape mode seq micro ckpt; do
      [ -n "$shape" ] || continue
      flags=(--shape "$shape" --mode "$mode" --seq "$seq" --micro "$micro")
      [ "$ckpt" = 1 ] && flags+=(--ckpt)
      ./.carry/trainq bench train "${flags[@]}" "$@" | tee -a "$OUT/trainq.jsonl" || true
      "$gpu_python" .carry/hf_peft_train.py "${flags[@]}" | tee -a "$OUT/peer.jsonl" || true
    done <<<"${ROWS:-$default_rows}"
    "$gpu_python" ops/bench/compare.py "$OUT/trainq.jsonl" "$OUT/peer.jsonl" | tee "$OUT/table.md"
    ;;
  peer)
    # One peer row: ops/bench/hf_peft_train.py ARGS (same flags as the shared script, plus --docs).
    device_env
    shift
    "$gpu_python" .carry/hf_peft_train.py "$@" | tee -a "$OUT/peer.jsonl"
    ;;
  check)
    device_env
    shift
    ./.carry/trainq bench check "$@" | tee -a "$OUT/check.jsonl"
    ;;
  packed)
    device_env
    shift
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    for shape in "16384 1" "4096 4"; do
      read -r seq micro <<<"$shape"
      ./.carry/trainq bench train --packed --seq "$seq" --micro "$micro" --docs-out "$OUT/docs-$seq.json" "$@" | tee -a "$OUT/trainq.jsonl"
      ./.carry/trainq bench train --skip-peak --seq "$seq" --micro "$micro" "$@" | tee -a "$OUT/trainq.jsonl"
      "$gpu_python" .carry/hf_peft_train.py --docs "$OUT/docs-$seq.json" "$@" | tee -a "$OUT/peer.jsonl"
    done
    "$gpu_python" ops/bench/compare.py "$OUT/trainq.jsonl" "$OUT/peer.jsonl" | tee "$OUT/table.md"
    ;;
  e2e)
    device_env
    shift
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    bash ops/e2e/start-services.sh > "$OUT/services.env"
    set -a; . "${TRAINQ_SERVICES:-/tmp/trainq-services}/env.sh"; set +a
    model=/tmp/qwen3-0.6b-random
    [ -f "$model/config.json" ] || "$gpu_python" ops/e2e/make_model.py "$model" >&2
    runs=$OUT/runs
    for mode in ${E2E_MODES:-async sync}; do
      mkdir -p "$runs/e2e-$mode"
      nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 1000 > "$runs/e2e-$mode/mem.csv" &
      sampler=$!
      OUT=$runs PY=$gpu_python bash ops/e2e/run.sh "e2e-$mode" "$model" "$mode" || echo "run $mode failed"
      kill "$sampler" || true
      "$gpu_python" ops/e2e/report.py "$runs/e2e-$mode" | tee -a "$OUT/e2e.jsonl"
      if [ -n "${PEFT_CHECK:-}" ]; then
        # Every committed checkpoint (KEEP_LAST large enough to keep them all) loaded by peft.
        "$gpu_python" ops/e2e/peft_check.py --model "e2e-$mode" --base "$model" --work "/tmp/peft-check-$mode" \
          --dtype "${PEFT_CHECK_DTYPE:-bf16}" \
          | tee -a "$OUT/peft-check.jsonl" || echo "peft check $mode failed"
      fi
    done
    tar czf "$OUT/e2e-runs.tgz" -C "$OUT" runs && rm -rf "$runs"
    ;;
  big)
    # The seed's model: a Qwen3-32B-shaped LoRA step, checkpointed, with and without activation
    # offloading, then the longest rows offloading fits (SEQS, default "32768 65536"), and the
    # peer with gradient checkpointing on the 1×8192 shape. H200 only (65 GiB of bf16 weights).
    device_env
    shift
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    big=(./.carry/trainq bench train --shape qwen3-32b --mode lora --micro 1 --warmup 1 --steps "${STEPS:-3}")
    "${big[@]}" --seq 8192 --ckpt "$@" | tee -a "$OUT/trainq.jsonl" || true
    "${big[@]}" --skip-peak --seq 8192 --ckpt --offload "$@" | tee -a "$OUT/trainq.jsonl" || true
    "$gpu_python" .carry/hf_peft_train.py --shape qwen3-32b --mode lora --seq 8192 --micro 1 --ckpt \
      --steps "${STEPS:-3}" | tee -a "$OUT/peer.jsonl" || true
    "$gpu_python" ops/bench/compare.py "$OUT/trainq.jsonl" "$OUT/peer.jsonl" | tee "$OUT/table.md"
    for seq in ${SEQS:-32768 65536}; do
      "${big[@]}" --skip-peak --seq "$seq" --ckpt --offload "$@" | tee -a "$OUT/trainq.jsonl" || true
    done
    ;;
  profile)
    device_env
    shift
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
    "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
      --log-file "$OUT/ncu.csv" ./.carry/trainq bench train --skip-peak --warmup 0 --steps 1 "$@" >/dev/null
    "$gpu_python" ops/bench/ncu_summary.py "$OUT/ncu.csv" 30 | tee "$OUT/profile.md"
    ;;
  *)
    echo "usage: ops/gpu.sh build | bench [ARGS] | train ARGS | trace ARGS | wide | peer ARGS | check [ARGS] | profile [ARGS] | packed [ARGS] | big [ARGS] | e2e" >&2
    exit 2
    ;;
esac
