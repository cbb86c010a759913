#!/usr/bin/env bash
# Runs trainq's whole test suite: installs what is missing (ops/setup.sh), then
#   1. formatting and lints: `cargo fmt --check`, `cargo clippy --all-targets -D warnings`;
#   2. the queue side without libtorch: `cargo tree` shows no tch, torch-sys or cudarc under
#      `trainq-queue` nor under `trainq --no-default-features`; the engine crate names no SQL
#      module; `trainq-queue`'s tests, and the `--no-default-features` CLI and the examples
#      that need no libtorch (submit_group, follow_checkpoints), built with LIBTORCH unset
#      (proves that submitting groups and fetching checkpoints need no torch install);
#   3. every test of the workspace (real PostgreSQL at $DATABASE_URL, each test in its own
#      database; tests that need S3 start their own S3-compatible server, moto).
# Extra arguments go to the last `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
env_file=$(bash ops/setup.sh)
# shellcheck disable=SC1090
source "$env_file"
step() { printf '\n=== %s\n' "$*" >&2; }

step "cargo fmt --check"
cargo fmt --all --check
step "cargo clippy (all targets, warnings are errors)"
cargo clippy --locked --workspace --all-targets -- -D warnings

step "queue side without libtorch"
(
  unset LIBTORCH LIBTORCH_BYPASS_VERSION_CHECK LD_LIBRARY_PATH
  if cargo tree --locked -p trainq-queue -e normal,build | grep -E '[ ─](tch|torch-sys|cudarc) v'; then
    echo "trainq-queue must not depend on tch, torch-sys or cudarc" >&2
    exit 1
  fi
  if cargo tree --locked -p trainq --no-default-features -e normal,build | grep -E '[ ─](tch|torch-sys|cudarc) v'; then
    echo "trainq --no-default-features must not depend on tch, torch-sys or cudarc" >&2
    exit 1
  fi
  # The engine runs no SQL: it reaches the queue crate only for config, the checkpoint format
  # and the error type (sqlx is not one of its dependencies, so it cannot name it either).
  if grep -rnE 'trainq_queue::(db|queue)\b|trainq_queue::\{[^}]*\b(db|queue)\b' crates/trainq-engine/src \
    | grep -vE '^[^:]+:[0-9]+:\s*//'; then
    echo "trainq-engine must not use trainq_queue::db or trainq_queue::queue" >&2
    exit 1
  fi
  cargo test --locked -p trainq-queue
  cargo build --locked --no-default-features --bin trainq --example submit_group --example follow_checkpoints
)

step "cargo test (workspace)"
cargo test --locked --workspace "$@"
