//! trainq's engine side: the parts that own libtorch (tch) and CUDA (cudarc).
//!
//! It is the layer below the `trainq` crate, which joins it with the queue side in its worker;
//! an embedder meets only [`Placement`] (where the ranks run), [`Error`] (inside `trainq::Error`)
//! and `tch` (re-exported, for `tch::Device`). The modules are public for the worker, the CLI's benchmarks
//! and the tests, and hidden from these docs:
//!
//! - `tokenize` renders chats through the model's template and tokenizer into ids, assistant
//!   masks and packed micro-batches (plain data).
//! - `model` is the tch transformer (Qwen3, Qwen2, Llama), LoRA, chunked log-probs and the loss.
//! - `kernels` holds our CUDA kernels (NVRTC at run time, launched through cudarc).
//! - `collective` sums tensors across ranks (NCCL, or in-process for tests).
//! - `train` runs one optimizer step over micro-batches and ranks.
//! - `checkpoint` writes and reads weight checkpoints (PEFT adapter or HF model + optimizer).
//! - `trace` records Kineto traces of steps for the benchmarks (libtorch's profiler).
//! - `engine` is the training actor the worker talks to: one thread per rank (a single GPU is
//!   a group of one), answering train / save / restore jobs.
//!
//! From `trainq-queue` it uses only the typed config (`trainq_queue::config`), the checkpoint
//! format tag (`trainq_queue::storage::CheckpointFormat`) and the error type. Nothing here runs
//! SQL: sqlx is not among its dependencies, and `ops/test.sh` checks that no `trainq_queue::db` or
//! `trainq_queue::queue` path appears in this crate. Async reaches only `engine` and the rank
//! threads of `train::ranks` (tokio channels to answer jobs, a cancellation token checked
//! between micro-batches); the model and the math are synchronous.

#[doc(hidden)]
pub mod checkpoint;
#[doc(hidden)]
pub mod collective;
#[doc(hidden)]
pub mod engine;
mod error;
#[doc(hidden)]
pub mod kernels;
#[doc(hidden)]
pub mod model;
mod shim_error;
#[doc(hidden)]
pub mod tokenize;
#[doc(hidden)]
pub mod trace;
#[doc(hidden)]
pub mod train;

pub use engine::Placement;
pub use error::{Error, Result};
pub use tch;
