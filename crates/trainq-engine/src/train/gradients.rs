//! Dropping the variables' gradients before a step's first backward (csrc/grads.cpp), so each
//! variable's first gradient is taken as computed instead of being added into a zeroed
//! `.grad`: for the 392 LoRA tensors of Qwen3-0.6B that is 784 kernel launches a step fewer.
//! A variable the backward never reaches is left without a gradient, which every reader of
//! gradients handles (zeros in the optimizer's flat gradient, skipped by norms, defined as zeros
//! before a data-parallel all-reduce). Without the shim (no `LIBTORCH` at build time) the
//! gradients are zeroed instead. One of the few `unsafe` modules.
#![allow(unsafe_code)]

use tch::Tensor;

use crate::error::{Error, Result};

#[cfg(trainq_shim)]
extern "C" {
    fn trainq_clear_grads(tensors: *const *const std::ffi::c_void, n: i64) -> *mut std::ffi::c_char;
}

/// Leaves every tensor of `vars` without a gradient (zeroes them where the shim is not built).
pub fn clear(vars: &[Tensor]) -> Result<()> {
    #[cfg(trainq_shim)]
    {
        let pointers: Vec<*const std::ffi::c_void> = vars.iter().map(|v| v.as_ptr().cast()).collect();
        // SAFETY: `pointers` are live tensors borrowed from `vars` for the call; the shim only
        // resets their autograd metadata and catches every C++ exception.
        let error = unsafe { trainq_clear_grads(pointers.as_ptr(), pointers.len() as i64) };
        crate::shim_error::check(error, "trainq_clear_grads").map_err(Error::torch("clear gradients"))
    }
    #[cfg(not(trainq_shim))]
    {
        for v in vars {
            v.shallow_clone().zero_grad();
        }
        Ok::<(), Error>(())
    }
}

#[cfg(all(test, trainq_shim))]
mod tests {
    use tch::{Device, Kind, Tensor};

    #[test]
    fn cleared_variables_have_no_gradient_and_the_next_backward_sets_it_fresh() {
        let a = Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        (&a * 2.0).sum(Kind::Float).backward();
        assert!(a.grad().defined());
        super::clear(&[a.shallow_clone()]).unwrap();
        assert!(!a.grad().defined(), "the gradient is dropped, not zeroed");
        (&a * 3.0).sum(Kind::Float).backward();
        assert_eq!(Vec::<f32>::try_from(a.grad()).unwrap(), vec![3.0; 3], "not accumulated onto the old one");
    }
}
