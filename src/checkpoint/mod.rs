//! Checkpoints: PEFT/HF safetensors writers, manifest, upload and fetch through object_store.

pub mod fetch;
pub mod manifest;
pub mod retention;
pub mod store;
pub mod transfer_retry;
pub mod upload;

pub use fetch::{fetch_checkpoint, read_manifest, FetchOptions};
pub use manifest::{CheckpointFormat, Manifest, ManifestFile};
pub use retention::{apply_retention, RetentionPolicy};
pub use store::{
    complete_steps, latest_complete_step, list_checkpoints, Store, StoreOptions, StoredCheckpoint,
    MANIFEST_FILE,
};
pub use transfer_retry::FileRetry;
pub use upload::{upload_checkpoint, Progress, UploadOptions, UploadedCheckpoint};
pub mod hf;
pub mod peft;
pub mod tensor_file;
