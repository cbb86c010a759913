"""Compiles every CUDA kernel source of crates/trainq-engine/src/kernels/ with NVRTC, here, with
no GPU: a compile error shows up before a device call is spent on it. Uses the NVRTC that the
setup's torch wheel ships (nvidia/cu13/lib), for the H200's compute capability by default.

    python3 ops/bench/nvrtc_check.py [--arch compute_90] [FILE.rs ...]   # default: every kernel file

Exits 1 when a source fails to compile, printing NVRTC's log.
"""
import argparse
import ctypes
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNELS = os.path.join(ROOT, "crates", "trainq-engine", "src", "kernels")


def nvrtc():
    """libnvrtc from the setup's venv (or the TRAINQ_PYTHON one), with its builtins on the path."""
    venv = os.path.dirname(os.path.dirname(os.environ.get("TRAINQ_PYTHON", os.path.expanduser("~/.cache/trainq/venv/bin/python"))))
    libs = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "nvidia", "cu13", "lib"))
    if not libs:
        sys.exit(f"no nvidia/cu13/lib under {venv}: run ops/setup.sh first")
    # libnvrtc loads libnvrtc-builtins by name: load it first from the same folder.
    ctypes.CDLL(glob.glob(os.path.join(libs[0], "libnvrtc-builtins.so*"))[0], mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(glob.glob(os.path.join(libs[0], "libnvrtc.so*"))[0])


def source_of(path, helpers):
    """The CUDA C of a kernels/*.rs file: the bf16 helpers, then its `SOURCE` raw string."""
    text = open(path).read()
    m = re.search(r'const SOURCE: &str = concat!\(\s*bf16_helpers!\(\),\s*r#"(.*?)"#\s*\);', text, re.S)
    return None if m is None else helpers + m.group(1)


def compile_source(lib, name, source, arch):
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None) != 0:
        return False, "nvrtcCreateProgram failed"
    opts = [f"--gpu-architecture={arch}".encode()]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc == 0, log.value.decode(errors="replace")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="compute_90")
    ap.add_argument("files", nargs="*")
    a = ap.parse_args()
    helpers = re.search(r'r#"(.*?)"#', open(os.path.join(KERNELS, "mod.rs")).read(), re.S).group(1)
    files = a.files or sorted(glob.glob(os.path.join(KERNELS, "*.rs")))
    lib = nvrtc()
    failed = False
    for path in files:
        source = source_of(path, helpers)
        if source is None:
            continue
        ok, log = compile_source(lib, os.path.basename(path), source, a.arch)
        print(f"{os.path.relpath(path, ROOT)}: {'ok' if ok else 'FAILED'}")
        if not ok or log.strip():
            print(log)
        failed |= not ok
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
