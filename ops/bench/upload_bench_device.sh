#!/usr/bin/env bash
# Runs ops/bench/upload_bench.sh on a machine without Rust or network (the 16-core GPU host),
# from what was prepared here and carried along in .carry/bench/:
#   upload_bench   the stripped examples/upload_bench binary (cargo build --example upload_bench)
#   pkgs.tar.xz    py/: moto 5.2.5, boto3 1.44.8 and their pure-Python dependencies (from
#                  $TRAINQ_PYTHON's venv); aws/: awscli 1.45.11 with its botocore 1.43.11
# usage: ops/bench/upload_bench_device.sh [SHARD_MIB] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${DEVICE_PYTHON:-$(command -v python3)}
pkgs=$(mktemp -d)
tar xJf .carry/bench/pkgs.tar.xz -C "$pkgs"
mkdir -p "$pkgs/bin"
cat > "$pkgs/bin/moto_server" <<SH
#!/bin/sh
PYTHONPATH=$pkgs/py exec $python -c 'import sys; from moto.server import main; sys.exit(main())' "\$@"
SH
cat > "$pkgs/bin/aws" <<SH
#!/bin/sh
PYTHONPATH=$pkgs/aws:$pkgs/py exec $python -c 'import sys; from awscli.clidriver import main; sys.exit(main())' "\$@"
SH
cat > "$pkgs/bin/python" <<SH
#!/bin/sh
PYTHONPATH=$pkgs/py exec $python "\$@"
SH
chmod +x "$pkgs/bin/"*
torch_dir=$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null || true)
export LD_LIBRARY_PATH=${torch_dir:+$torch_dir/lib:}${LD_LIBRARY_PATH:-}
export PATH=$pkgs/bin:$PATH TRAINQ_PYTHON=$pkgs/bin/python TRAINQ_MOTO=$pkgs/bin/moto_server
export BENCH_BIN=.carry/bench/upload_bench
echo "# host: $(nproc) cores, $("$python" -V)" >&2
bash ops/bench/upload_bench.sh "$@"
