import ctypes, re, sys, glob
lib = ctypes.CDLL(glob.glob('/root/.cache/trainq/venv/lib/python3.11/site-packages/nvidia/cu13/lib/libnvrtc.so*')[0])
helpers = None
def extract(path):
    s = open(path).read()
    m = re.search(r'const SOURCE: &str = concat!\(\s*bf16_helpers!\(\),\s*r#"(.*?)"#\s*\);', s, re.S)
    return m.group(1)
mod = open('/work/main/crates/trainq-engine/src/kernels/mod.rs').read()
helpers = re.search(r'r#"(.*?)"#', mod, re.S).group(1)
for path in sys.argv[1:]:
    src = (helpers + extract(path)).encode()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, path.encode(), 0, None, None) == 0
    opts = [b"--gpu-architecture=compute_90"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t(); lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value); lib.nvrtcGetProgramLog(prog, log)
    print(path, 'rc', rc, log.value.decode()[:3000])
