//! Test harness shared by the integration tests: a fresh PostgreSQL database per test and a real
//! S3-compatible server (moto) per test that needs one.
#![allow(dead_code, unreachable_pub)]

pub mod checkpoint_files;
pub mod db;
pub mod s3;
pub mod tcp_proxy;
