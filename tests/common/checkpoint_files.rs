//! Checkpoint-like directories for storage tests: files of chosen sizes with seeded random
//! content, and a byte-for-byte comparison of two directories.

use std::path::Path;

use rand::{RngCore, SeedableRng};

/// A PEFT-shaped checkpoint: an adapter of `adapter_bytes`, its config, and a nested file.
pub fn peft_layout(adapter_bytes: usize) -> Vec<(&'static str, usize)> {
    vec![
        ("adapter_model.safetensors", adapter_bytes),
        ("adapter_config.json", 700),
        ("training_state/optimizer.safetensors", 64 * 1024),
    ]
}

/// Writes `files` (relative path, size) under `dir` with content seeded by `seed`.
pub fn write_checkpoint_dir(dir: &Path, files: &[(&str, usize)], seed: u64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for (name, size) in files {
        let path = dir.join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let mut content = vec![0u8; *size];
        rng.fill_bytes(&mut content);
        std::fs::write(&path, content).unwrap();
    }
}

/// Asserts that `fetched` holds exactly `files` plus `manifest.json`, each byte-identical to
/// the file of the same name under `original`.
pub fn assert_same_files(original: &Path, fetched: &Path, files: &[(&str, usize)]) {
    let mut expected: Vec<String> = files.iter().map(|(name, _)| name.to_string()).collect();
    expected.push("manifest.json".into());
    expected.sort();
    assert_eq!(trainq_queue::storage::manifest::list_all_files(fetched).unwrap(), expected);
    for (name, _) in files {
        let a = std::fs::read(original.join(name)).unwrap();
        let b = std::fs::read(fetched.join(name)).unwrap();
        assert!(a == b, "{name} differs after the round trip ({} vs {} bytes)", a.len(), b.len());
    }
}
