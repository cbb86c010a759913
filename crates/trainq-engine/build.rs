//! Compiles the engine's C++ shim against the libtorch that tch links: csrc/offload.cpp
//! (activation offloading on a side stream, through c10's device-generic stream and event
//! interfaces), csrc/flash_varlen.cpp (variable-length flash attention, which tch does not
//! bind), csrc/trace.cpp (libtorch's Kineto profiler, for the benchmarks' traces) and
//! csrc/fused_ops.cpp (autograd functions around the fused q/k/v, SwiGLU and projection ops),
//! csrc/grads.cpp (dropping variables' gradients); csrc/guarded.h is their shared error
//! convention. Without `LIBTORCH` (e.g. a docs build) the
//! shim is left out: packed attention runs per segment, offloading copies synchronously and the
//! layers run on libtorch's tensor ops, and gradients are zeroed instead of dropped.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-changed=csrc/flash_varlen.cpp");
    println!("cargo:rerun-if-changed=csrc/offload.cpp");
    println!("cargo:rerun-if-changed=csrc/trace.cpp");
    println!("cargo:rerun-if-changed=csrc/fused_ops.cpp");
    println!("cargo:rerun-if-changed=csrc/grads.cpp");
    println!("cargo:rerun-if-changed=csrc/guarded.h");
    println!("cargo:rustc-check-cfg=cfg(trainq_flash_varlen)");
    println!("cargo:rustc-check-cfg=cfg(trainq_shim)");
    let Some(libtorch) = std::env::var_os("LIBTORCH").map(PathBuf::from) else {
        return;
    };
    let include = libtorch.join("include");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag_if_supported("-Wno-unused-parameter")
        .warnings(false)
        .file("csrc/offload.cpp")
        .file("csrc/trace.cpp")
        .file("csrc/fused_ops.cpp")
        .file("csrc/grads.cpp");
    let flash = include.join("ATen/ops/_flash_attention_forward.h").is_file();
    if flash {
        build.file("csrc/flash_varlen.cpp");
    } else {
        println!(
            "cargo:warning=libtorch at {} has no _flash_attention_forward header: packed attention runs per segment",
            libtorch.display()
        );
    }
    build.compile("trainq_shim");
    // One cfg for every file above (built together); flash_varlen has its own (its header may
    // be missing).
    println!("cargo:rustc-cfg=trainq_shim");
    if flash {
        println!("cargo:rustc-cfg=trainq_flash_varlen");
    }
}
