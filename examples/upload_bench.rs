//! Upload throughput of trainq's checkpoint uploader, for ops/bench/upload_bench.sh.
//!
//! `upload_bench ENDPOINT BUCKET PREFIX DIR`: uploads DIR once as checkpoint step 1 of model
//! `bench` to `s3://BUCKET/PREFIX` on the S3 server at ENDPOINT (credentials `test`/`test`),
//! with the default [`UploadOptions`], and prints one JSON line: bytes, seconds, MB/s.
//! For tuning, `BENCH_PART_MIB`, `BENCH_PARTS_IN_FLIGHT`, `BENCH_FILES_IN_FLIGHT` and
//! `BENCH_THRESHOLD_MIB` override the defaults, and `BENCH_UNSIGNED_PAYLOAD=true` skips SigV4
//! payload hashing.

use std::time::Instant;

use trainq_queue::storage::{upload_checkpoint, CheckpointFormat, Store, StoreOptions, UploadOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [endpoint, bucket, prefix, dir] = args.as_slice() else {
        return Err("usage: upload_bench ENDPOINT BUCKET PREFIX DIR".into());
    };
    let mut options = StoreOptions { from_env: false, ..StoreOptions::default() };
    for (key, value) in [
        ("aws_endpoint", endpoint.as_str()),
        ("aws_allow_http", "true"),
        ("aws_access_key_id", "test"),
        ("aws_secret_access_key", "test"),
        ("aws_region", "us-east-1"),
    ] {
        options.config.push((key.to_string(), value.to_string()));
    }
    if let Ok(unsigned) = std::env::var("BENCH_UNSIGNED_PAYLOAD") {
        options.config.push(("aws_unsigned_payload".to_string(), unsigned));
    }
    let store = Store::open_with(&format!("s3://{bucket}/{prefix}"), &options)?;
    let runtime = tokio::runtime::Runtime::new()?;
    let started = Instant::now();
    let uploaded = runtime.block_on(upload_checkpoint(
        &store,
        "bench",
        trainq_queue::StepNumber(1),
        CheckpointFormat::HfFull,
        std::path::Path::new(dir),
        &upload_options(),
        &|_| {},
    ))?;
    let seconds = started.elapsed().as_secs_f64();
    let mb_per_s = uploaded.total_bytes as f64 / 1e6 / seconds;
    println!(
        r#"{{"client": "trainq", "bytes": {}, "seconds": {seconds:.3}, "mb_per_s": {mb_per_s:.1}}}"#,
        uploaded.total_bytes
    );
    Ok(())
}

fn env_number(name: &str) -> Option<usize> {
    std::env::var(name).ok().map(|v| v.parse().unwrap_or_else(|_| panic!("{name}={v} is not a number")))
}

fn upload_options() -> UploadOptions {
    let mut options = UploadOptions::default();
    const MIB: usize = 1024 * 1024;
    if let Some(mib) = env_number("BENCH_PART_MIB") {
        options.part_size = mib * MIB;
    }
    if let Some(mib) = env_number("BENCH_THRESHOLD_MIB") {
        options.multipart_threshold = (mib * MIB) as u64;
    }
    options.parts_in_flight = env_number("BENCH_PARTS_IN_FLIGHT").unwrap_or(options.parts_in_flight);
    options.files_in_flight = env_number("BENCH_FILES_IN_FLIGHT").unwrap_or(options.files_in_flight);
    options
}
