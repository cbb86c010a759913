//! `manifest.json`: the list of a checkpoint's files with sizes and sha256, written after every
//! file so that its presence means the checkpoint is whole.

use std::path::Path as FsPath;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::ids::StepNumber;

/// Version of the manifest layout written by this code.
pub const MANIFEST_VERSION: u32 = 1;

/// How the weights in a checkpoint are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckpointFormat {
    /// PEFT adapter: `adapter_model.safetensors` + `adapter_config.json`.
    PeftLora,
    /// Hugging Face full model: `model*.safetensors` + `config.json`.
    HfFull,
}

impl CheckpointFormat {
    /// The name stored in the manifest and in `trainq.checkpoints.format`.
    pub fn as_str(self) -> &'static str {
        match self {
            CheckpointFormat::PeftLora => "peft_lora",
            CheckpointFormat::HfFull => "hf_full",
        }
    }
}

/// One uploaded file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestFile {
    /// Path relative to the checkpoint directory, `/`-separated.
    pub path: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Lower-case hex sha256 of the content.
    pub sha256: String,
}

/// The content of `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Layout version (`MANIFEST_VERSION`).
    pub version: u32,
    /// The model the checkpoint belongs to.
    pub model: String,
    /// The optimizer step the checkpoint was taken after.
    pub step: StepNumber,
    /// How the weights are laid out.
    pub format: CheckpointFormat,
    /// Every file of the checkpoint, sorted by path.
    pub files: Vec<ManifestFile>,
    /// Sum of the files' sizes.
    pub total_bytes: u64,
    /// When the upload finished.
    pub created_at: DateTime<Utc>,
    /// The `trainq` version that wrote it.
    pub writer: String,
}

impl Manifest {
    /// A manifest for `files` (sorted here), stamped now.
    pub fn new(model: &str, step: StepNumber, format: CheckpointFormat, mut files: Vec<ManifestFile>) -> Self {
        files.sort_by(|a, b| a.path.cmp(&b.path));
        let total_bytes = files.iter().map(|f| f.bytes).sum();
        Manifest {
            version: MANIFEST_VERSION,
            model: model.to_string(),
            step,
            format,
            files,
            total_bytes,
            created_at: Utc::now(),
            writer: format!("trainq {}", env!("CARGO_PKG_VERSION")),
        }
    }

    /// The pretty-printed JSON that is uploaded.
    pub fn to_json(&self) -> Result<Vec<u8>> {
        serde_json::to_vec_pretty(self).map_err(Error::json(format!("manifest of {} step {}", self.model, self.step)))
    }

    /// Parses a downloaded manifest and checks that it is self-consistent and about `model`/`step`.
    pub fn from_json(bytes: &[u8], model: &str, step: StepNumber) -> Result<Manifest> {
        let manifest: Manifest =
            serde_json::from_slice(bytes).map_err(Error::json(format!("manifest of {model} step {step}")))?;
        manifest.validate(model, step)?;
        Ok(manifest)
    }

    /// Checks the fields a fetch relies on.
    pub fn validate(&self, model: &str, step: StepNumber) -> Result<()> {
        let fail =
            |message: String| Err(Error::Checkpoint { path: format!("{model} step {step} manifest.json"), message });
        if self.model != model || self.step != step {
            return fail(format!("describes {} step {}", self.model, self.step));
        }
        if self.total_bytes != self.files.iter().map(|f| f.bytes).sum::<u64>() {
            return fail("total_bytes is not the sum of the file sizes".into());
        }
        for file in &self.files {
            if !is_safe_relative_path(&file.path) {
                return fail(format!("file path {:?} leaves the checkpoint directory", file.path));
            }
            if file.sha256.len() != 64 || !file.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return fail(format!("{}: sha256 {:?} is not 64 hex digits", file.path, file.sha256));
            }
        }
        Ok(())
    }
}

/// Lower-case hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// True when `path` is relative, `/`-separated, and has no empty, `.` or `..` component.
pub fn is_safe_relative_path(path: &str) -> bool {
    !path.is_empty()
        && !path.starts_with('/')
        && !path.contains('\\')
        && path.split('/').all(|part| !part.is_empty() && part != "." && part != "..")
}

/// The files of a local checkpoint directory to upload: [`list_all_files`] without the
/// top-level `manifest.json` (the upload writes its own).
pub fn list_checkpoint_files(dir: &FsPath) -> Result<Vec<String>> {
    let mut found = list_all_files(dir)?;
    found.retain(|path| path != super::store::MANIFEST_FILE);
    Ok(found)
}

/// Lists the regular files under `dir` recursively as `/`-separated relative paths, sorted.
pub fn list_all_files(dir: &FsPath) -> Result<Vec<String>> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(current) = pending.pop() {
        for entry in std::fs::read_dir(&current).map_err(Error::io(&current))? {
            let entry = entry.map_err(Error::io(&current))?;
            let path = entry.path();
            let kind = std::fs::metadata(&path).map_err(Error::io(&path))?;
            if kind.is_dir() {
                pending.push(path);
            } else if kind.is_file() {
                let relative = path.strip_prefix(dir).expect("entry is under dir");
                let parts: Vec<_> = relative.components().map(|c| c.as_os_str().to_string_lossy()).collect();
                found.push(parts.join("/"));
            }
        }
    }
    found.sort();
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str, bytes: u64) -> ManifestFile {
        ManifestFile { path: path.into(), bytes, sha256: sha256_hex(path.as_bytes()) }
    }

    #[test]
    fn manifest_round_trips_through_json_with_sorted_files_and_totals() {
        let files = vec![file("b.safetensors", 10), file("a.json", 5)];
        let manifest = Manifest::new("m", StepNumber(3), CheckpointFormat::PeftLora, files);
        assert_eq!(manifest.files[0].path, "a.json");
        assert_eq!(manifest.total_bytes, 15);
        let json = manifest.to_json().unwrap();
        assert!(String::from_utf8_lossy(&json).contains("\"format\": \"peft_lora\""));
        assert_eq!(Manifest::from_json(&json, "m", StepNumber(3)).unwrap(), manifest);
    }

    #[test]
    fn manifests_for_another_step_or_with_escaping_paths_are_refused() {
        let json = Manifest::new("m", StepNumber(3), CheckpointFormat::HfFull, vec![file("x", 1)]).to_json().unwrap();
        let err = Manifest::from_json(&json, "m", StepNumber(4)).unwrap_err().to_string();
        assert!(err.contains("describes m step 3"), "{err}");
        let bad = Manifest::new("m", StepNumber(3), CheckpointFormat::HfFull, vec![file("../etc/passwd", 1)]);
        let err = Manifest::from_json(&bad.to_json().unwrap(), "m", StepNumber(3)).unwrap_err().to_string();
        assert!(err.contains("leaves the checkpoint directory"), "{err}");
    }

    #[test]
    fn safe_relative_paths_exclude_absolute_dot_and_empty_components() {
        assert!(is_safe_relative_path("a/b.json"));
        for bad in ["", "/a", "a//b", "./a", "a/../b", "a\\b"] {
            assert!(!is_safe_relative_path(bad), "{bad}");
        }
    }

    #[test]
    fn checkpoint_directories_are_listed_recursively_without_the_manifest() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        for name in ["z.bin", "sub/a.bin", "manifest.json"] {
            std::fs::write(dir.path().join(name), b"x").unwrap();
        }
        assert_eq!(list_checkpoint_files(dir.path()).unwrap(), vec!["sub/a.bin", "z.bin"]);
    }
}
