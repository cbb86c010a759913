//! Compiles the one C++ file of the engine (csrc/flash_varlen.cpp: variable-length flash
//! attention, which tch does not bind) against the libtorch that tch links. Without `LIBTORCH`
//! (e.g. a docs build) the shim is left out and packed attention runs per segment.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-changed=csrc/flash_varlen.cpp");
    println!("cargo:rustc-check-cfg=cfg(trainq_flash_varlen)");
    let Some(libtorch) = std::env::var_os("LIBTORCH").map(PathBuf::from) else {
        return;
    };
    let include = libtorch.join("include");
    if !include.join("ATen/ops/_flash_attention_forward.h").is_file() {
        println!(
            "cargo:warning=libtorch at {} has no _flash_attention_forward header: packed attention runs per segment",
            libtorch.display()
        );
        return;
    }
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag_if_supported("-Wno-unused-parameter")
        .warnings(false)
        .file("csrc/flash_varlen.cpp")
        .compile("trainq_flash_varlen");
    println!("cargo:rustc-cfg=trainq_flash_varlen");
}
