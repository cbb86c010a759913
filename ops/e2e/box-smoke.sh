#!/usr/bin/env bash
# One-shot check of the carried services on the lent GPU machine (run from the repo root there):
#   run(command="bash ops/e2e/box-smoke.sh", carry=[".carry"], kind="nvidia-h200", timeout_s=240)
# Starts both services, queries PostgreSQL, round-trips an S3 object, writes a 2-layer random
# Qwen3 model with the carried tokenizer, then (if FULL=1, default) times the full 28-layer one.
set -uo pipefail
cd "$(dirname "$0")/../.."
py=${PY:-/opt/torch/.venv/bin/python}
[ -x "$py" ] || py=$(command -v python3)
echo "== box: $(. /etc/os-release; echo "$PRETTY_NAME"), $(ldd --version | head -1), $(nproc) cores, user $(id -un)"
echo "== tools: curl=$(command -v curl || echo none) setpriv=$(command -v setpriv || echo none) useradd=$(command -v useradd || echo none) xz=$(command -v xz || echo none)"
df -h /dev/shm /tmp | tail -n +2
ls -la .carry

echo "== start-services"
svc=${TRAINQ_SERVICES:-/tmp/trainq-services}
t0=$(date +%s%N)
bash ops/e2e/start-services.sh > /tmp/services.env || { echo "start-services FAILED"; exit 1; }
echo "took $(( ($(date +%s%N) - t0) / 1000000 )) ms"
cat /tmp/services.env
set -a; . "$svc/env.sh"; set +a

echo "== daemons still up after the script returned"
ps -eo pid,user,etime,args | grep -E 'postgres -D|s3s-fs' | grep -v grep | cut -c1-150
echo "== ldd on the box (carried binaries)"
for f in "$TRAINQ_SERVICES_BIN/postgres" "$TRAINQ_SERVICES_BIN/psql" "$svc/s3/s3s-fs"; do
  echo "$f:"; ldd "$f" | sed 's/ (0x.*//; s/^/   /'
done

echo "== psql"
"$TRAINQ_SERVICES_BIN/psql" "$DATABASE_URL" -Atc 'select version()'
"$TRAINQ_SERVICES_BIN/psql" "$DATABASE_URL" -Atc "select current_user, inet_server_addr(), inet_server_port(), current_setting('fsync'), current_setting('TimeZone')"
echo "== migrations (plain psql, one transaction each, in a scratch database that is dropped after)"
"$TRAINQ_SERVICES_BIN/psql" "$DATABASE_URL" -qc 'drop database if exists e2e_smoke' -c 'create database e2e_smoke'
for f in migrations/*.sql; do
  "$TRAINQ_SERVICES_BIN/psql" "${DATABASE_URL%/*}/e2e_smoke" -q -v ON_ERROR_STOP=1 -1 -f "$f" >/dev/null && echo "ok $f" || echo "FAIL $f"
done
"$TRAINQ_SERVICES_BIN/psql" "$DATABASE_URL" -qc 'drop database e2e_smoke'

echo "== s3"
"$py" ops/e2e/s3_smoke.py
if command -v curl >/dev/null; then curl -s -o /dev/null -w 'unsigned curl GET: %{http_code}\n' "$AWS_ENDPOINT/$TRAINQ_S3_BUCKET/"; fi

echo "== make_model --layers 2"
rm -rf /tmp/qwen3-2l
time "$py" ops/e2e/make_model.py /tmp/qwen3-2l --layers 2 --check 2>&1 | grep -v -E 'shards|Loading weights'
ls -la /tmp/qwen3-2l

if [ "${FULL:-1}" = 1 ]; then
  echo "== make_model full 28 layers (cpu init)"
  rm -rf /tmp/qwen3-0.6b-random
  time timeout 120 "$py" ops/e2e/make_model.py /tmp/qwen3-0.6b-random 2>&1 | grep -v -E 'shards|Loading weights'
  ls -la /tmp/qwen3-0.6b-random
fi

echo "== stop"
bash ops/e2e/start-services.sh stop
echo "== box-smoke done"
