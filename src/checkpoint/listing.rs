//! Which checkpoints of a model are in the store: one listing of
//! `{prefix}/{model}/checkpoints/`, grouped by step, telling whole checkpoints (manifest present)
//! from partial ones (an upload that failed or is still running).

use std::collections::BTreeMap;

use futures::TryStreamExt;
use object_store::path::Path;

use super::store::{Store, MANIFEST_FILE};
use crate::error::{Error, Result};

/// The objects of one step's checkpoint directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredCheckpoint {
    /// The step, parsed from the directory name.
    pub step: u64,
    /// True when `manifest.json` exists: the checkpoint is whole.
    pub has_manifest: bool,
    /// Every object key under the step's directory, manifest included.
    pub objects: Vec<Path>,
}

/// Lists every checkpoint directory of `model`, sorted by step. Directories whose name is not a
/// step number are ignored.
pub async fn list_checkpoints(store: &Store, model: &str) -> Result<Vec<StoredCheckpoint>> {
    let dir = store.checkpoints_dir(model);
    let metas: Vec<_> = store
        .object_store()
        .list(Some(&dir))
        .try_collect()
        .await
        .map_err(|source| Error::Store { what: "list", path: dir.to_string(), source })?;
    let depth = dir.parts().count();
    let mut by_step: BTreeMap<u64, StoredCheckpoint> = BTreeMap::new();
    for meta in metas {
        let parts: Vec<_> = meta.location.parts().skip(depth).collect();
        let Some(step) = parts.first().and_then(|p| p.as_ref().parse::<u64>().ok()) else {
            continue;
        };
        let entry = by_step
            .entry(step)
            .or_insert_with(|| StoredCheckpoint { step, has_manifest: false, objects: Vec::new() });
        if parts.len() == 2 && parts[1].as_ref() == MANIFEST_FILE {
            entry.has_manifest = true;
        }
        entry.objects.push(meta.location);
    }
    Ok(by_step.into_values().collect())
}

/// The steps of `model` whose checkpoint is whole (manifest present), ascending.
pub async fn complete_steps(store: &Store, model: &str) -> Result<Vec<u64>> {
    let listed = list_checkpoints(store, model).await?;
    Ok(listed.into_iter().filter(|c| c.has_manifest).map(|c| c.step).collect())
}

/// The highest step of `model` whose manifest exists, if any.
pub async fn latest_complete_step(store: &Store, model: &str) -> Result<Option<u64>> {
    Ok(complete_steps(store, model).await?.last().copied())
}
