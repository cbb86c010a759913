//! CUDA kernels of trainq's own, for work libtorch has no fused op for that tch can reach: the
//! CUDA source is compiled at run time by NVRTC (loaded dynamically, like NCCL, so CPU builds and
//! CI never need CUDA) and launched through cudarc's driver API on the device's legacy default
//! stream, the stream libtorch's kernels run on in trainq, so they are ordered with them.
//!
//! Besides `dist::nccl`, this is the only module with `unsafe` code: kernel launches on raw
//! device pointers of tch tensors.
#![allow(unsafe_code)]

/// CUDA C shared by the kernel sources: bf16 ↔ f32 (one value, or eight in a 16-byte word) with
/// bf16 held as `unsigned short` (NVRTC compiles without CUDA's headers), rounding to nearest
/// even as libtorch does, NaN kept NaN.
macro_rules! bf16_helpers {
    () => {
        r#"
__device__ __forceinline__ float bf16_to_float(unsigned short x) { return __uint_as_float(((unsigned int)x) << 16); }
__device__ __forceinline__ unsigned short float_to_bf16(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
// Eight bf16 of a 16-byte word to f32 and back.
__device__ __forceinline__ void unpack8(uint4 w, float* v) {
    unsigned int parts[4] = {w.x, w.y, w.z, w.w};
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        v[2 * i] = __uint_as_float(parts[i] << 16);
        v[2 * i + 1] = __uint_as_float(parts[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ uint4 pack8(const float* v) {
    unsigned int parts[4];
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        parts[i] = (unsigned int)float_to_bf16(v[2 * i]) | ((unsigned int)float_to_bf16(v[2 * i + 1]) << 16);
    }
    return make_uint4(parts[0], parts[1], parts[2], parts[3]);
}
"#
    };
}

mod adamw;
mod fused;
mod softmax;

pub use adamw::{fused_adamw_step, AdamWScalars};
pub use fused::{
    AddNormArgs, FusedLaunchers, QkvArgs, SwiGluArgs, ADD_NORM_MAX_WIDTH, LAUNCHERS as FUSED_LAUNCHERS,
    NORM_GRAD_BLOCKS,
};
pub use softmax::softmax_rows_in_place;

use tch::Device;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

use crate::error::{Error, Result};

/// A compiled module and the context it lives in, per CUDA ordinal.
struct Loaded {
    ctx: Arc<CudaContext>,
    module: Arc<CudaModule>,
}

/// Why our kernels cannot run on `device` (not CUDA, no NVRTC, a compile or load failure), or
/// `None` when they can. Compiles each source once per device (cached). Callers fall back to
/// tensor ops on `Some`; once this says `None`, a failing launch is a real error.
pub fn unavailable(device: Device) -> Option<String> {
    let Device::Cuda(ordinal) = device else { return Some(format!("{device:?} is not a CUDA device")) };
    let sources = [adamw::SOURCE_NAME_AND_KERNEL, softmax::SOURCE_NAME_AND_KERNEL, fused::SOURCE_NAME_AND_KERNEL];
    sources
        .into_iter()
        .find_map(|(name, source, kernel)| function(ordinal, name, source, kernel).err().map(|e| e.to_string()))
}

/// Compiled modules (or why compiling failed) by (CUDA ordinal, source name).
type ModuleCache = Mutex<HashMap<(usize, &'static str), Result<Arc<Loaded>>>>;

/// Compiles `source` for device `ordinal` once per process (cached by the source's name) and
/// returns the context and the function `name` in it.
fn function(
    ordinal: usize,
    source_name: &'static str,
    source: &str,
    name: &str,
) -> Result<(Arc<CudaContext>, CudaFunction)> {
    static CACHE: OnceLock<ModuleCache> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let mut cache = cache.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let loaded =
        cache.entry((ordinal, source_name)).or_insert_with(|| compile(ordinal, source_name, source).map(Arc::new));
    let loaded = match loaded {
        Ok(loaded) => loaded.clone(),
        Err(err) => return Err(Error::Kernel(format!("{err}"))),
    };
    let f = loaded.module.load_function(name).map_err(|e| kernel_error(source_name, format!("load {name}: {e:?}")))?;
    Ok((loaded.ctx.clone(), f))
}

fn compile(ordinal: usize, source_name: &'static str, source: &str) -> Result<Loaded> {
    // cudarc panics when it cannot load a library (libcuda, libnvrtc): a failure like any other
    let compiled = std::panic::catch_unwind(|| -> Result<Loaded> {
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| kernel_error(source_name, format!("CUDA context {ordinal}: {e:?}")))?;
        let (major, minor) = ctx.compute_capability().map_err(|e| kernel_error(source_name, format!("{e:?}")))?;
        let options = CompileOptions {
            options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
            name: Some(source_name.to_string()),
            ..CompileOptions::default()
        };
        let ptx =
            compile_ptx_with_opts(source, options).map_err(|e| kernel_error(source_name, format!("NVRTC: {e}")))?;
        let module = ctx.load_module(ptx).map_err(|e| kernel_error(source_name, format!("load module: {e:?}")))?;
        Ok(Loaded { ctx, module })
    });
    compiled.unwrap_or_else(|_| {
        Err(kernel_error(source_name, "a CUDA library (libcuda, libnvrtc.so) could not be loaded".into()))
    })
}

fn kernel_error(source_name: &str, message: String) -> Error {
    Error::Kernel(format!("CUDA kernel {source_name}: {message}"))
}
