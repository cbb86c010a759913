//! The C++ shim's error convention (csrc/*.cpp): an entry point returns null on success, or a
//! malloc'd message that only the shim's `trainq_free_message` may release. Every module that
//! calls the shim reads its errors through [`message`] (or [`check`]). One of the few `unsafe` modules.
#![allow(unsafe_code)]

#[cfg(trainq_shim)]
use std::ffi::{c_char, CStr};

#[cfg(trainq_shim)]
extern "C" {
    fn trainq_free_message(message: *mut c_char);
}

/// `None` when `error` is null (success); otherwise its message, after releasing it.
#[cfg(trainq_shim)]
pub(crate) fn message(error: *mut c_char) -> Option<String> {
    if error.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated string from strdup in the shim, read once and released once with
    // the shim's own free.
    let message = unsafe { CStr::from_ptr(error) }.to_string_lossy().into_owned();
    unsafe { trainq_free_message(error) };
    Some(message)
}

/// [`message`] as a libtorch error of the model's calls: `what: message`.
#[cfg(trainq_shim)]
pub(crate) fn check(error: *mut c_char, what: &str) -> Result<(), tch::TchError> {
    message(error).map_or(Ok(()), |m| Err(tch::TchError::Torch(format!("{what}: {m}"))))
}
