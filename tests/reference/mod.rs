//! Runs tests/reference/model_ref.py (with $TRAINQ_PYTHON) once per test binary and hands the
//! tests its output directory and tensors.
#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use tch::{Device, Tensor};

/// Largest absolute difference allowed between our f32 numbers and transformers'.
pub const TOLERANCE: f64 = 1e-4;

/// The generator's output directory, made on first use in this test binary.
pub fn dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().unwrap();
        let name = exe.file_name().unwrap().to_string_lossy().to_string();
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("model_reference").join(name);
        let _ = std::fs::remove_dir_all(&dir);
        run(&["models", dir.to_str().unwrap()]);
        dir
    })
}

/// Runs the generator script with `args`, failing the test with its stderr on error.
pub fn run(args: &[&str]) {
    let python = std::env::var("TRAINQ_PYTHON")
        .expect("TRAINQ_PYTHON must name a python with torch, transformers and peft (source ~/.cache/trainq/env.sh)");
    let mut script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/model_ref.py");
    if !script.exists() {
        // a test binary copied to another machine runs from the repository root
        script = PathBuf::from("tests/reference/model_ref.py");
    }
    let out = Command::new(python).arg(script).args(args).output().expect("run the reference generator");
    assert!(out.status.success(), "model_ref.py {args:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
}

/// The named tensor of a safetensors file.
pub fn tensor(file: &Path, name: &str) -> Tensor {
    Tensor::read_safetensors(file)
        .unwrap()
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no {name} in {}", file.display()))
        .1
        .to(Device::Cpu)
}

/// Largest absolute difference of two tensors, as f64.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size(), "shapes differ");
    (a.to_kind(tch::Kind::Double) - b.to_kind(tch::Kind::Double)).abs().max().double_value(&[])
}
