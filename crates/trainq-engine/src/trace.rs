//! Kineto traces of training steps (csrc/trace.cpp, libtorch's own profiler): every CUDA kernel
//! (on a CPU run, every operator) between [`start`] and [`stop`], saved as a Chrome trace for
//! `ops/bench/trace_summary.py`. For the benchmarks; without the shim (no `LIBTORCH` at build
//! time) both return an error. One of the few `unsafe` modules (with kernels/,
//! collective/nccl and the model's shim calls).
#![allow(unsafe_code)]

use std::path::Path;

use crate::error::{Error, Result};

#[cfg(trainq_shim)]
extern "C" {
    fn trainq_trace_start(cuda: i32, ops: i32) -> *mut std::ffi::c_char;
    fn trainq_trace_stop(path: *const std::ffi::c_char) -> *mut std::ffi::c_char;
}

/// Starts recording CUDA kernels when `cuda` (and with `ops` the CPU operators that launch
/// them, so each kernel can be traced to its operator), else CPU operators.
pub fn start(cuda: bool, ops: bool) -> Result<()> {
    #[cfg(trainq_shim)]
    {
        // SAFETY: no arguments to keep alive; the shim catches every C++ exception.
        check(unsafe { trainq_trace_start(i32::from(cuda), i32::from(ops)) })
    }
    #[cfg(not(trainq_shim))]
    {
        let _ = (cuda, ops);
        Err(not_built())
    }
}

/// Stops recording and writes the trace (Chrome JSON) to `path`.
pub fn stop(path: &Path) -> Result<()> {
    #[cfg(trainq_shim)]
    {
        let c_path = std::ffi::CString::new(path.to_string_lossy().into_owned())
            .map_err(|_| Error::config("trace", format!("path {} holds a NUL byte", path.display())))?;
        // SAFETY: `c_path` outlives the call; the shim catches every C++ exception.
        check(unsafe { trainq_trace_stop(c_path.as_ptr()) })
    }
    #[cfg(not(trainq_shim))]
    {
        let _ = path;
        Err(not_built())
    }
}

#[cfg(trainq_shim)]
fn check(error: *mut std::ffi::c_char) -> Result<()> {
    crate::shim_error::message(error).map_or(Ok(()), |message| Err(Error::config("trace", message)))
}

#[cfg(not(trainq_shim))]
fn not_built() -> Error {
    Error::config("trace", "the profiler shim was not built (no LIBTORCH at build time)")
}

#[cfg(all(test, trainq_shim))]
mod tests {
    use tch::{Device, Kind, Tensor};

    #[test]
    fn a_trace_of_cpu_work_is_a_chrome_trace_that_names_its_operators() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("step.json");
        super::start(false, false).unwrap();
        let a = Tensor::ones([64, 64], (Kind::Float, Device::Cpu));
        let _ = a.matmul(&a).sum(Kind::Float);
        super::stop(&path).unwrap();
        let trace: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let events = trace["traceEvents"].as_array().expect("a Chrome trace has traceEvents");
        let names: Vec<&str> = events.iter().filter_map(|e| e["name"].as_str()).collect();
        assert!(names.iter().any(|n| n.contains("matmul") || n.contains("mm")), "no matmul among {names:?}");
    }
}
