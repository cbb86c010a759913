//! The only Rust code that holds SQL: one module per table, and the embedded migrations.
