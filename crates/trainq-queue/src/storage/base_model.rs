//! Where the base model comes from: a local directory, or a prefix in an object store
//! (`s3://bucket/models/qwen3-0.6b`), copied once into the worker's work directory; and its
//! vocabulary size, read from its `config.json`.

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

/// The vocabulary size in the base model's `config.json` (`vocab_size`, or `text_config.vocab_size`
/// for multimodal configs) at `base` (a directory, `file://` URL or object-store prefix):
/// `Ok(None)` when there is no config.json or it names no size; an error when it cannot be read
/// or parsed.
pub async fn read_vocab_size(base: &str) -> Result<Option<i64>> {
    let bytes = if !base.contains("://") || base.starts_with("file://") {
        let path = PathBuf::from(base.strip_prefix("file://").unwrap_or(base)).join("config.json");
        match std::fs::read(&path) {
            Ok(bytes) => bytes::Bytes::from(bytes),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(err) => return Err(Error::io(&path)(err)),
        }
    } else {
        let store = Store::open(base)?;
        let url = url::Url::parse(base).map_err(|e| Error::config("base", format!("{base}: {e}")))?;
        let key = object_store::path::Path::parse(format!("{}/config.json", url.path().trim_matches('/')))
            .map_err(|e| Error::config("base", format!("{base}: {e}")))?;
        match get_bytes(store.object_store().as_ref(), &key).await {
            Ok(bytes) => bytes,
            Err(Error::Store { source: object_store::Error::NotFound { .. }, .. }) => return Ok(None),
            Err(err) => return Err(err),
        }
    };
    let config: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(Error::json(format!("{base}/config.json")))?;
    Ok(vocab_size_of(&config))
}

/// `vocab_size` of a Hugging Face config (top level, else `text_config`), when it is a positive integer.
fn vocab_size_of(config: &serde_json::Value) -> Option<i64> {
    [&config["vocab_size"], &config["text_config"]["vocab_size"]]
        .into_iter()
        .find_map(serde_json::Value::as_i64)
        .filter(|n| *n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vocab_size_comes_from_the_top_level_or_the_text_config() {
        assert_eq!(vocab_size_of(&serde_json::json!({"vocab_size": 151936})), Some(151936));
        assert_eq!(vocab_size_of(&serde_json::json!({"text_config": {"vocab_size": 262144}})), Some(262144));
        assert_eq!(vocab_size_of(&serde_json::json!({"vocab_size": "big"})), None);
        assert_eq!(vocab_size_of(&serde_json::json!({})), None);
    }

    #[tokio::test]
    async fn a_directory_without_config_json_has_no_known_vocab_size() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_vocab_size(dir.path().to_str().unwrap()).await.unwrap(), None);
        std::fs::write(dir.path().join("config.json"), r#"{"vocab_size": 32}"#).unwrap();
        assert_eq!(read_vocab_size(dir.path().to_str().unwrap()).await.unwrap(), Some(32));
    }
}
