//! Compiles the engine's C++ shim against the libtorch that tch links: csrc/offload.cpp
//! (activation offloading on a side stream, through c10's device-generic stream and event
//! interfaces), csrc/flash_varlen.cpp (variable-length flash attention, which tch does not
//! bind), csrc/trace.cpp (libtorch's Kineto profiler, for the benchmarks' traces) and
//! csrc/fused_ops.cpp (autograd functions around the fused q/k/v, SwiGLU and projection ops),
//! csrc/grads.cpp (dropping variables' gradients); csrc/guarded.h is their shared error
//! convention. csrc/cudnn_varlen.cpp (cuDNN's ragged attention for packed documents) is built
//! on its own when the cudnn frontend's headers (`CUDNN_FRONTEND_INCLUDE`, ops/setup.sh) and the
//! torch wheel's cuDNN and CUDA headers are there. Without `LIBTORCH` (e.g. a docs build) the
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
    println!("cargo:rerun-if-changed=csrc/cudnn_varlen.cpp");
    println!("cargo:rerun-if-env-changed=CUDNN_FRONTEND_INCLUDE");
    println!("cargo:rustc-check-cfg=cfg(trainq_cudnn_varlen)");
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
    cudnn_varlen(&libtorch);
}

/// Compiles csrc/cudnn_varlen.cpp when every header it needs is at hand: the cudnn frontend
/// (header-only), and cuDNN's and the CUDA runtime's from the torch wheel's nvidia packages.
/// cuDNN and the CUDA runtime themselves are found at run time (the frontend's dynamic loading),
/// so nothing new is linked but c10_cuda (the current stream).
fn cudnn_varlen(libtorch: &std::path::Path) {
    let frontend = std::env::var_os("CUDNN_FRONTEND_INCLUDE").map(PathBuf::from);
    let nvidia = libtorch.join("../nvidia");
    let cudnn = nvidia.join("cudnn/include");
    let cuda =
        ["cu13", "cuda_runtime"].iter().map(|d| nvidia.join(d).join("include")).find(|d| d.join("cuda.h").is_file());
    let (Some(frontend), Some(cuda)) = (frontend.filter(|f| f.join("cudnn_frontend.h").is_file()), cuda) else {
        println!("cargo:warning=no cudnn frontend or CUDA headers (CUDNN_FRONTEND_INCLUDE): packed attention uses flash varlen");
        return;
    };
    if !cudnn.join("cudnn.h").is_file() {
        println!("cargo:warning=no cudnn.h under {}: packed attention uses flash varlen", cudnn.display());
        return;
    }
    let include = libtorch.join("include");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .include(&frontend)
        .include(&cudnn)
        .include(&cuda)
        .warnings(false)
        .file("csrc/cudnn_varlen.cpp")
        .compile("trainq_cudnn_varlen");
    println!("cargo:rustc-link-lib=dylib=c10_cuda");
    println!("cargo:rustc-cfg=trainq_cudnn_varlen");
}
