#!/usr/bin/env python3
"""Stdlib-only S3 smoke test (SigV4, path-style) against the server started by start-services.sh.

PUTs a small object, GETs it back, lists the bucket. Reads AWS_ENDPOINT, AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_REGION and TRAINQ_S3_BUCKET (source /tmp/trainq-services/env.sh).
s3s-fs checks signatures, so a plain unsigned curl PUT would get 403.

    python3 ops/e2e/s3_smoke.py [KEY]
"""
import datetime
import hashlib
import hmac
import os
import sys
import urllib.parse
import urllib.request


def signed_request(method, url, body, access_key, secret_key, region):
    u = urllib.parse.urlsplit(url)
    now = datetime.datetime.now(datetime.timezone.utc)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload_hash = hashlib.sha256(body or b"").hexdigest()
    headers = {"host": u.netloc, "x-amz-content-sha256": payload_hash, "x-amz-date": amz_date}
    signed = ";".join(sorted(headers))
    q = sorted(urllib.parse.parse_qsl(u.query, keep_blank_values=True))
    cq = "&".join(f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}" for k, v in q)
    creq = "\n".join([method, urllib.parse.quote(u.path or "/", safe="/-_.~"), cq,
                      "".join(f"{k}:{headers[k]}\n" for k in sorted(headers)), signed, payload_hash])
    scope = f"{day}/{region}/s3/aws4_request"
    sts = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(creq.encode()).hexdigest()])
    k = ("AWS4" + secret_key).encode()
    for part in (day, region, "s3", "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    sig = hmac.new(k, sts.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, "
                                f"SignedHeaders={signed}, Signature={sig}")
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, r.read()


def main():
    ep = os.environ.get("AWS_ENDPOINT", "http://127.0.0.1:9000").rstrip("/")
    ak = os.environ.get("AWS_ACCESS_KEY_ID", "trainq")
    sk = os.environ.get("AWS_SECRET_ACCESS_KEY", "trainq-secret")
    region = os.environ.get("AWS_REGION", "us-east-1")
    bucket = os.environ.get("TRAINQ_S3_BUCKET", "trainq")
    key = sys.argv[1] if len(sys.argv) > 1 else "smoke/hello.txt"
    body = f"hello from s3_smoke at {datetime.datetime.now(datetime.timezone.utc).isoformat()}".encode()
    st, _ = signed_request("PUT", f"{ep}/{bucket}/{key}", body, ak, sk, region)
    print(f"PUT {bucket}/{key}: {st}")
    st, got = signed_request("GET", f"{ep}/{bucket}/{key}", None, ak, sk, region)
    print(f"GET {bucket}/{key}: {st}, {len(got)} bytes, match={got == body}")
    st, lst = signed_request("GET", f"{ep}/{bucket}?list-type=2", None, ak, sk, region)
    keys = lst.decode().count("<Key>")
    print(f"LIST {bucket}: {st}, {keys} key(s)")
    if got != body:
        sys.exit("s3_smoke: body mismatch")


if __name__ == "__main__":
    main()
