//! Row-wise softmax over the vocabulary for the chunked log-probs, in place on bf16 logits: one
//! kernel reads a chunk's (C, vocab) logits twice and writes the probabilities once, giving each
//! row's log-prob of its target from the same pass (libtorch has no bf16→f32 log-softmax kernel,
//! so the tensor-op path first writes an f32 copy of the logits).

use cudarc::driver::{LaunchConfig, PushKernelArg};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

const SOURCE_NAME: &str = "trainq_softmax.cu";

/// (source name, source, one of its kernels), for [`super::unavailable`].
pub(super) const SOURCE_NAME_AND_KERNEL: (&str, &str, &str) = (SOURCE_NAME, SOURCE, "softmax_rows_bf16");

const SOURCE: &str = concat!(
    bf16_helpers!(),
    r#"
#define NEG_INF __int_as_float(0xff800000)

// (m, s) of a running log-sum-exp: max and sum of exp(x - max).
__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
    float top = fmaxf(m, m2);
    if (top == NEG_INF) return;
    s = s * expf(m - top) + s2 * expf(m2 - top);
    m = top;
}

__device__ void block_logsumexp(float& m, float& s) {
    __shared__ float shared_m[32];
    __shared__ float shared_s[32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
        float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
        combine(m, s, m2, s2);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    if (lane == 0) { shared_m[warp] = m; shared_s[warp] = s; }
    __syncthreads();
    if (warp == 0) {
        m = lane < warps ? shared_m[lane] : NEG_INF;
        s = lane < warps ? shared_s[lane] : 0.0f;
        for (int offset = 16; offset > 0; offset >>= 1) {
            float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
            float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
            combine(m, s, m2, s2);
        }
        if (lane == 0) { shared_m[0] = m; shared_s[0] = s; }
    }
    __syncthreads();
    m = shared_m[0];
    s = shared_s[0];
}

// One block per row: logprobs[row] = x[t] - logsumexp(x); then x <- softmax(x), in place. Rows
// whose length is a multiple of 8 are read and written 16 bytes at a time, with one rescale of
// the running sum per 8 values. Both orders favour the L2 cache: blocks take the rows last row
// first (the GEMM that wrote the chunk wrote those last), and the second pass walks its row
// backwards (the lines the first pass read last are the likeliest still cached).
extern "C" __global__ void __launch_bounds__(1024) softmax_rows_bf16(unsigned short* logits, const long long* targets,
                                             float* logprobs, long long vocab) {
    long long row = (long long)gridDim.x - 1 - blockIdx.x;
    unsigned short* x = logits + row * vocab;
    float m = NEG_INF, s = 0.0f;
    bool vec = (vocab & 7) == 0;
    if (vec) {
        const uint4* xv = (const uint4*)x;
        for (long long i = threadIdx.x; i < vocab / 8; i += blockDim.x) {
            float v[8];
            unpack8(xv[i], v);
            float top = v[0];
            #pragma unroll
            for (int j = 1; j < 8; j++) top = fmaxf(top, v[j]);
            if (top > m) { s = (m == NEG_INF) ? 0.0f : s * __expf(m - top); m = top; }
            if (m != NEG_INF) {
                #pragma unroll
                for (int j = 0; j < 8; j++) s += __expf(v[j] - m);
            }
        }
    } else {
        for (long long i = threadIdx.x; i < vocab; i += blockDim.x) {
            float v = bf16_to_float(x[i]);
            if (v > m) { s = s * expf(m - v) + 1.0f; m = v; } else if (v != NEG_INF) { s += expf(v - m); }
        }
    }
    block_logsumexp(m, s);
    if (threadIdx.x == 0) {
        long long t = targets[row];
        logprobs[row] = (t >= 0 && t < vocab) ? bf16_to_float(x[t]) - m - logf(s) : 0.0f;
    }
    __syncthreads();
    float inv = 1.0f / s;
    if (vec) {
        uint4* xv = (uint4*)x;
        for (long long i = vocab / 8 - 1 - threadIdx.x; i >= 0; i -= blockDim.x) {
            float v[8];
            unpack8(xv[i], v);
            #pragma unroll
            for (int j = 0; j < 8; j++) v[j] = __expf(v[j] - m) * inv;
            xv[i] = pack8(v);
        }
    } else {
        for (long long i = vocab - 1 - threadIdx.x; i >= 0; i -= blockDim.x) {
            x[i] = float_to_bf16(expf(bf16_to_float(x[i]) - m) * inv);
        }
    }
}
"#
);

/// Checks the shapes the kernels assume: `rows` (C, V) bf16 contiguous on CUDA, `targets` (C,)
/// i64 and `per_row` (C,) f32, contiguous on the same device. Returns (ordinal, C, V).
fn check(rows: &Tensor, targets: &Tensor, per_row: &Tensor) -> Result<(usize, i64, i64)> {
    let Device::Cuda(ordinal) = rows.device() else {
        return Err(Error::Kernel("the softmax kernels run on CUDA tensors only".into()));
    };
    let size = rows.size();
    let fits = |t: &Tensor, kind: Kind| {
        t.device() == rows.device() && t.kind() == kind && t.size() == [size[0]] && t.is_contiguous()
    };
    if size.len() != 2
        || rows.kind() != Kind::BFloat16
        || !rows.is_contiguous()
        || !fits(targets, Kind::Int64)
        || !fits(per_row, Kind::Float)
    {
        return Err(Error::Kernel(format!("softmax kernels: expected contiguous (C, V) bf16 rows with (C,) i64 targets and f32 values, got {:?} {size:?}", rows.kind())));
    }
    Ok((ordinal, size[0], size[1]))
}

fn launch(kernel: &str, rows: &Tensor, targets: &Tensor, per_row: &Tensor) -> Result<()> {
    let (ordinal, count, vocab) = check(rows, targets, per_row)?;
    if count == 0 {
        return Ok(());
    }
    let (ctx, f) = super::function(ordinal, SOURCE_NAME, SOURCE, kernel)?;
    let stream = ctx.default_stream();
    let (x, t, v) = (rows.data_ptr() as u64, targets.data_ptr() as u64, per_row.data_ptr() as u64);
    let cfg = LaunchConfig { grid_dim: (count as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
    let mut builder = stream.launch_builder(&f);
    builder.arg(&x).arg(&t).arg(&v).arg(&vocab);
    // SAFETY: `rows` is a live contiguous (count, vocab) bf16 buffer, `targets` and `per_row`
    // live contiguous (count,) i64 / f32 buffers on the same device (checked above), owned by
    // tensors that outlive the launch; each block touches its own row and entry only. Queued on
    // the legacy default stream, after libtorch's work that produced them.
    unsafe { builder.launch(cfg) }.map_err(|e| Error::Kernel(format!("{kernel} launch: {e:?}")))?;
    Ok(())
}

/// Replaces each row of `logits` (C, V) bf16 by its softmax and writes
/// `log softmax(row)[targets[row]]` into `logprobs` (C,) f32 (0 for a target outside the row).
pub fn softmax_rows_in_place(logits: &Tensor, targets: &Tensor, logprobs: &Tensor) -> Result<()> {
    launch("softmax_rows_bf16", logits, targets, logprobs)
}
