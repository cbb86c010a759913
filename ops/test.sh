#!/usr/bin/env bash
# Runs trainq's whole test suite: installs what is missing (ops/setup.sh), then
#   1. formatting and lints: `cargo fmt --check`, `cargo clippy --all-targets -D warnings`;
#   2. the queue side without libtorch: `trainq-queue`'s tests and the `--no-default-features`
#      CLI, built with LIBTORCH unset (proves that submitting groups and fetching checkpoints
#      need no torch install);
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
  cargo test --locked -p trainq-queue
  cargo build --locked --no-default-features --bin trainq
)

step "cargo test (workspace)"
cargo test --locked --workspace "$@"
