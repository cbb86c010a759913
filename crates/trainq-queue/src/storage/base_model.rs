//! Where the base model comes from: a local directory, or a prefix in an object store
//! (`s3://bucket/models/qwen3-0.6b`), copied once into the worker's work directory.

use std::path::{Path, PathBuf};

use futures::TryStreamExt;
use object_store::{ObjectStore, ObjectStoreExt};

use super::Store;
use crate::error::{Error, Result};

/// The local directory holding the base model named by `base` (a path, `file://` URL, or an
/// object-store URL whose files are downloaded into `work_dir/base` unless already there).
pub async fn resolve_base_model(base: &str, work_dir: &Path) -> Result<PathBuf> {
    let local = base.strip_prefix("file://").unwrap_or(base);
    if !base.contains("://") || base.starts_with("file://") {
        let dir = PathBuf::from(local);
        if !dir.join("config.json").is_file() {
            return Err(Error::config(
                "base",
                format!("{}: no config.json: not a Hugging Face model directory", dir.display()),
            ));
        }
        return Ok(dir);
    }
    let target = work_dir.join("base");
    if target.join(".complete").is_file() {
        return Ok(target);
    }
    let store = Store::open(base)?;
    let inner = store.object_store();
    let prefix =
        object_store::path::Path::parse(url::Url::parse(base).map(|u| u.path().to_string()).unwrap_or_default())
            .map_err(|e| Error::config("base", format!("{base}: {e}")))?;
    let objects: Vec<_> = inner.list(Some(&prefix)).try_collect().await.map_err(|source| Error::Store {
        what: "list",
        path: base.to_string(),
        source,
    })?;
    if objects.is_empty() {
        return Err(Error::NotFound { what: format!("base model objects under {base}") });
    }
    for meta in objects {
        let rel = meta
            .location
            .prefix_match(&prefix)
            .map(|parts| parts.map(|p| p.as_ref().to_string()).collect::<Vec<_>>().join("/"));
        let Some(rel) = rel.filter(|r| !r.is_empty()) else { continue };
        let path = target.join(&rel);
        let parent = path.parent().unwrap_or(&target);
        std::fs::create_dir_all(parent).map_err(Error::io(parent))?;
        let bytes = get_bytes(inner.as_ref(), &meta.location).await?;
        std::fs::write(&path, &bytes).map_err(Error::io(&path))?;
    }
    std::fs::write(target.join(".complete"), b"").map_err(Error::io(&target))?;
    Ok(target)
}

async fn get_bytes(store: &dyn ObjectStore, location: &object_store::path::Path) -> Result<bytes::Bytes> {
    let wrap = |source| Error::Store { what: "get", path: location.to_string(), source };
    store.get(location).await.map_err(wrap)?.bytes().await.map_err(wrap)
}
