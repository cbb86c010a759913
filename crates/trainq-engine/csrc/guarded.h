// The shim's error convention, shared by every entry point in csrc/: run the body and return
// nullptr, or catch a C++ exception and return its message as a malloc'd string that the Rust
// side reads once and releases with trainq_free_message (offload.cpp; crate::shim_error).
#pragma once
#include <cstdlib>
#include <cstring>
#include <exception>

template <typename Body>
char* guarded(Body&& body) {
  try {
    body();
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
