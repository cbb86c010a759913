//! Link flags for libtorch: keep `libtorch_cuda` (rustc's `--as-needed` would drop it, since
//! nothing refers to it by symbol, and CUDA would then never be available) and add run-time
//! search paths for the libtorch we built against and the GPU machine's torch.

use std::path::PathBuf;

/// Where the GPU machines keep torch (see ops/gpu.sh); added as a second rpath.
const GPU_MACHINE_TORCH_LIB: &str = "/opt/torch/.venv/lib/python3.12/site-packages/torch/lib";

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    // sqlx::migrate!() embeds migrations/ at compile time: rebuild when they change.
    println!("cargo:rerun-if-changed=migrations");
    let Some(libtorch) = std::env::var_os("LIBTORCH").map(PathBuf::from) else {
        return;
    };
    let lib = libtorch.join("lib");
    if lib.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    println!("cargo:rustc-link-arg=-Wl,-rpath,{GPU_MACHINE_TORCH_LIB}");
}
