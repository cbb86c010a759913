#!/usr/bin/env bash
# The whole trainq loop on this machine: installs what is missing (ops/setup.sh), then
# `trainq demo` — local PostgreSQL, a file:// checkpoint store, a tiny Qwen3-shaped model and
# tokenizer built in-process, and a toy task whose reward rises as the worker trains.
# Extra arguments go to `trainq demo` (see `trainq demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
env_file=$(bash ops/setup.sh)
# shellcheck disable=SC1090
source "$env_file"
cargo run --locked --quiet -- demo "$@"
