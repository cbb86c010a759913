//! Weight checkpoints in object storage: the store, the manifest, upload, fetch and retention
//! through object_store. The files themselves are written by the engine (`trainq_engine::checkpoint`).

pub mod base_model;
pub mod fetch;
pub mod manifest;
pub mod retention;
pub mod store;
pub mod transfer_retry;
pub mod upload;

pub use base_model::{read_vocab_size, resolve_base_model};
pub use fetch::{fetch_checkpoint, read_manifest, FetchOptions};
pub use manifest::{CheckpointFormat, Manifest, ManifestFile};
pub use retention::{apply_retention, RetentionPolicy};
pub use store::{
    complete_steps, latest_complete_step, list_checkpoints, store_url_of, Store, StoreOptions, StoredCheckpoint,
    MANIFEST_FILE,
};
pub use transfer_retry::FileRetry;
pub use upload::{upload_checkpoint, Progress, UploadOptions, UploadedCheckpoint};
