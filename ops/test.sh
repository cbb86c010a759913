#!/usr/bin/env bash
# Runs trainq's whole test suite: installs what is missing (ops/setup.sh), then cargo test.
# Tests use the local PostgreSQL ($DATABASE_URL, each test in its own database) and start their
# own S3-compatible server (moto). Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
env_file=$(bash ops/setup.sh)
# shellcheck disable=SC1090
source "$env_file"
cargo test --locked "$@"
