//! Chat template and tokenizer to token ids, assistant masks and packed micro-batches.
//!
//! [`ChatTokenizer`] turns a [`Trajectory`] (chat messages or pre-tokenized ids) into a
//! [`TokenizedTrajectory`]; [`pack`] lays tokenized trajectories with their advantages out as
//! [`MicroBatch`]es. Plain Rust data only: tensors are made in `train`. See docs/training.md.

pub mod assistant_spans;
pub mod chat_template;
pub mod chat_tokenizer;
pub mod packing;
pub mod trajectory;

pub use chat_template::{ChatTemplate, PreparedConversation, RenderRequest};
pub use chat_tokenizer::ChatTokenizer;
pub use packing::{pack, MicroBatch, PackItem, PAD_TOKEN_ID};
pub use trajectory::{TokenizeError, TokenizedTrajectory, Trajectory};
