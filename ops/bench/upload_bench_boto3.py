"""The reference uploads for ops/bench/upload_bench.sh: boto3 `upload_file` (default
TransferConfig: 8 MiB threshold and parts, 10 threads) of every file of DIR, one file after the
other, as a user script would; prints one JSON line like examples/upload_bench.rs.

usage: upload_bench_boto3.py ENDPOINT BUCKET PREFIX DIR
"""
import json
import os
import sys
import time

import boto3


def main(endpoint, bucket, prefix, root):
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test",
                      aws_secret_access_key="test", region_name="us-east-1")
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names)
    total = sum(os.path.getsize(f) for f in files)
    started = time.perf_counter()
    for path in files:
        key = f"{prefix}/bench/checkpoints/000001/{os.path.relpath(path, root)}"
        s3.upload_file(path, bucket, key)
    seconds = time.perf_counter() - started
    print(json.dumps({"client": "boto3", "bytes": total, "seconds": round(seconds, 3),
                      "mb_per_s": round(total / 1e6 / seconds, 1)}))


if __name__ == "__main__":
    main(*sys.argv[1:5])
