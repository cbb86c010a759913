//! Reading HF weights into a var store: `model.safetensors`, or the shards named by
//! `model.safetensors.index.json`; every variable must be filled, no checkpoint key left over.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use tch::Tensor;

use crate::error::{Error, Result};

/// The safetensors files of an HF model directory, in a stable order.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index_path = dir.join("model.safetensors.index.json");
    if !index_path.exists() {
        return Err(Error::model(dir, "neither model.safetensors nor model.safetensors.index.json found"));
    }
    let text = std::fs::read_to_string(&index_path).map_err(Error::io(&index_path))?;
    let index: serde_json::Value =
        serde_json::from_str(&text).map_err(Error::json(index_path.display().to_string()))?;
    let map = index["weight_map"].as_object().ok_or_else(|| Error::model(&index_path, "no weight_map object"))?;
    let files: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
    Ok(files.into_iter().map(|f| dir.join(f)).collect())
}

/// Copies every tensor of `files` into the variable that `rename` maps its key to (converting
/// dtype and device); `rename` returning `None` skips a key (e.g. a tied `lm_head`). Fails on a
/// key that names no variable, a shape mismatch, or a variable that no file provided.
pub fn fill_variables(
    vars: &HashMap<String, Tensor>,
    files: &[PathBuf],
    rename: impl Fn(&str) -> Option<String>,
) -> Result<()> {
    let mut missing: BTreeSet<&str> = vars.keys().map(|k| k.as_str()).collect();
    for file in files {
        let tensors = Tensor::read_safetensors(file).map_err(Error::torch(format!("read {}", file.display())))?;
        for (key, value) in tensors {
            let Some(name) = rename(&key) else { continue };
            let Some((name, var)) = vars.get_key_value(&name) else {
                return Err(Error::model(file, format!("tensor {key} has no place in this model")));
            };
            if var.size() != value.size() {
                let msg = format!("tensor {key} has shape {:?}, the model expects {:?}", value.size(), var.size());
                return Err(Error::model(file, msg));
            }
            let mut var = var.shallow_clone();
            tch::no_grad(|| var.f_copy_(&value)).map_err(Error::torch(format!("copy {key}")))?;
            missing.remove(name.as_str());
        }
    }
    match missing.into_iter().next() {
        None => Ok(()),
        Some(name) => {
            let path = files.first().map(|f| f.as_path()).unwrap_or(Path::new(""));
            Err(Error::model(path, format!("no tensor for {name} in the checkpoint")))
        }
    }
}
