//! `trainq demo`: the whole loop on one CPU machine — a tiny Qwen3-shaped model and tokenizer
//! built in-process, a toy task that samples from the latest checkpoint and submits groups
//! through the SQL API, the worker training on them, and a reward-per-step table and plot.

pub mod assets;
pub mod run;
pub mod sample;
pub mod task;
