//! trainq's engine side: the parts that own libtorch (tch) and CUDA (cudarc).
//!
//! - [`tokenize`] renders chats through the model's template and tokenizer into ids, assistant
//!   masks and packed micro-batches (plain data).
//! - [`model`] is the tch transformer (Qwen3, Qwen2, Llama), LoRA, chunked log-probs and the loss.
//! - [`kernels`] holds our CUDA kernels (NVRTC at run time, launched through cudarc).
//! - [`collective`] sums tensors across ranks (NCCL, or in-process for tests).
//! - [`train`] runs one optimizer step over micro-batches and ranks.
//! - [`checkpoint`] writes and reads weight checkpoints (PEFT adapter or HF model + optimizer).
//! - [`engine`] is the training actor the worker talks to: one thread per rank (a single GPU is
//!   a group of one), answering train / save / restore jobs.
//!
//! It depends on `trainq-queue` only for the typed config and the pure RL math. Nothing here
//! touches SQL; only [`engine`] touches async (to answer over channels).

pub mod checkpoint;
pub mod collective;
pub mod engine;
mod error;
pub mod kernels;
pub mod model;
pub mod tokenize;
pub mod train;

pub use error::{Error, Result};
pub use tch;
