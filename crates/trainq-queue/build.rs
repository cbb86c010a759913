//! `sqlx::migrate!` embeds ../../migrations at compile time but cannot tell cargo to watch the
//! folder on stable Rust: without this, a new migration file would not rebuild the crate.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
