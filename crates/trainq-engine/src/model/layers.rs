//! The building blocks of the transformer: linear projections with an optional LoRA adapter,
//! RMSNorm and rotary position embeddings, each mirroring its Hugging Face counterpart.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tch::{nn, Device, Kind, TchError, Tensor};

use super::fused_ops::{projection, ProjectionInput};
use super::hf_config::{HfConfig, RopeKind};

/// Results of libtorch calls inside the model; mapped to the crate error at the public API.
pub(crate) type TchResult<T> = Result<T, TchError>;

/// How variables of a new model are created: their dtype, whether the base weights train, and
/// whether they get a random init (`from_config`) or are left to be overwritten (`load`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Init {
    pub(crate) kind: Kind,
    pub(crate) base_trainable: bool,
    pub(crate) random: bool,
    /// Std of the normal init of linear and embedding weights (HF `initializer_range`).
    pub(crate) std: f64,
}

impl Init {
    /// Adds a weight of `dims` under `path/name`: normal(0, std) or ones, or uninitialized.
    pub(crate) fn weight(&self, path: &nn::Path<'_>, name: &str, dims: &[i64], ones: bool) -> TchResult<Tensor> {
        let options = (self.kind, path.device());
        let t = match (self.random, ones) {
            (false, _) => Tensor::f_empty(dims, options)?,
            (true, true) => Tensor::f_ones(dims, options)?,
            (true, false) => Tensor::f_randn(dims, options)?.f_mul_scalar(self.std)?,
        };
        Ok(path.add(name, t, self.base_trainable))
    }

    /// Adds a bias of `dims` (zeros when random).
    pub(crate) fn bias(&self, path: &nn::Path<'_>, dims: &[i64]) -> TchResult<Tensor> {
        let t = Tensor::f_zeros(dims, (self.kind, path.device()))?;
        Ok(path.add("bias", t, self.base_trainable))
    }
}

/// LoRA for one projection, PEFT semantics: `y = W x + (alpha / r) · B (A x)`.
#[derive(Debug)]
pub(crate) struct LoraAdapter {
    /// (r, in), kaiming-uniform init like PEFT (bound 1/sqrt(in)).
    pub(crate) lora_a: Tensor,
    /// (out, r), zeros at init so the adapter starts as the identity.
    pub(crate) lora_b: Tensor,
    pub(crate) scale: f64,
    pub(crate) enabled: Arc<AtomicBool>,
}

/// A linear projection `x W^T + b` with HF's parameter names (`weight`, `bias`) and, when
/// targeted, LoRA parameters `lora_A.weight` and `lora_B.weight`.
#[derive(Debug)]
pub(crate) struct Linear {
    pub(crate) weight: Tensor,
    pub(crate) bias: Option<Tensor>,
    pub(crate) lora: Option<LoraAdapter>,
}

/// What a [`Linear`] needs to know about LoRA: rank, scale, shared on/off switch, targets.
#[derive(Debug, Clone)]
pub(crate) struct LoraSpec {
    pub(crate) rank: i64,
    pub(crate) scale: f64,
    pub(crate) targets: Vec<String>,
    pub(crate) enabled: Arc<AtomicBool>,
}

impl Linear {
    /// Creates `path/{weight,bias}` (out, in) and, when `path`'s last name is a LoRA target,
    /// `path/lora_A/weight` (r, in) and `path/lora_B/weight` (out, r).
    pub(crate) fn new(
        path: nn::Path<'_>,
        in_dim: i64,
        out_dim: i64,
        bias: bool,
        init: &Init,
        lora: Option<&LoraSpec>,
    ) -> TchResult<Self> {
        let weight = init.weight(&path, "weight", &[out_dim, in_dim], false)?;
        let bias = if bias { Some(init.bias(&path, &[out_dim])?) } else { None };
        let name = path.components().last().unwrap_or_default().to_string();
        let lora = match lora {
            Some(spec) if spec.targets.contains(&name) => {
                let options = (init.kind, path.device());
                let name = format!("{}.lora_A.weight", path.components().collect::<Vec<_>>().join("."));
                let a = lora_a_init(&name, spec.rank, in_dim)?.f_to_device_(options.1, options.0, false, false)?;
                let b = Tensor::f_zeros([out_dim, spec.rank], options)?;
                Some(LoraAdapter {
                    lora_a: (&path / "lora_A").add("weight", a, true),
                    lora_b: (&path / "lora_B").add("weight", b, true),
                    scale: spec.scale,
                    enabled: spec.enabled.clone(),
                })
            }
            _ => None,
        };
        Ok(Self { weight, bias, lora })
    }

    /// (…, in) -> (…, out); with `fused` through the projection op of `model::fused_ops`.
    pub(crate) fn forward(&self, x: &Tensor, fused: bool) -> TchResult<Tensor> {
        project(x, &self.weight, self.bias.as_ref(), self.adapter().as_ref(), fused)
    }

    /// The adapter when there is one and it is enabled.
    pub(crate) fn adapter(&self) -> Option<LowRank> {
        let l = self.lora.as_ref().filter(|l| l.enabled.load(Ordering::Relaxed))?;
        Some(LowRank { a: l.lora_a.shallow_clone(), b: l.lora_b.shallow_clone(), scale: l.scale })
    }
}

/// A LoRA term `s · (x Aᵀ) Bᵀ`: A (k, in), B (out, k), scale s.
#[derive(Debug)]
pub(crate) struct LowRank {
    pub(crate) a: Tensor,
    pub(crate) b: Tensor,
    pub(crate) scale: f64,
}

/// `x Wᵀ + b + s · (x Aᵀ) Bᵀ` for x (…, in) -> (…, out), the adapter optional: with `fused` one
/// op of `model::fused_ops` (CUDA, bf16), else a GEMM and the adapter added into its output in
/// place.
pub(crate) fn project(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    lora: Option<&LowRank>,
    fused: bool,
) -> TchResult<Tensor> {
    let size = output_size(x, weight.size()[0]);
    let y = if fused {
        projection(&x.f_reshape([-1, weight.size()[1]])?, weight, bias, lora, ProjectionInput::Plain)?
    } else {
        let mut y = linear_rows(x, weight, bias)?;
        if let Some(lora) = lora {
            add_low_rank_(&mut y, x, lora)?;
        }
        y
    };
    y.f_view(size.as_slice())
}

/// `x Wᵀ + b` for x (…, in) as a fresh (rows, out) matrix that no view shares, so that a LoRA
/// term can be added into it in place ([`add_low_rank_`]).
fn linear_rows(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> TchResult<Tensor> {
    let rows = x.f_reshape([-1, weight.size()[1]])?;
    let weight_t = weight.f_transpose(0, 1)?;
    match bias {
        Some(b) => b.f_addmm(&rows, &weight_t),
        None => rows.f_mm(&weight_t),
    }
}

/// `y += s · (x Aᵀ) Bᵀ` in place for y (rows, out) from [`linear_rows`] and x (…, in): the
/// low-rank product scaled where it is smallest, then one GEMM whose epilogue adds into `y` (no
/// copy of `y`, no separate sum).
fn add_low_rank_(y: &mut Tensor, x: &Tensor, lora: &LowRank) -> TchResult<()> {
    // (rows, in) -> (rows, k)
    let low_rank = x.f_reshape([-1, lora.a.size()[1]])?.f_mm(&lora.a.f_transpose(0, 1)?)?.f_mul_scalar(lora.scale)?;
    let _ = y.f_addmm_(&low_rank, &lora.b.f_transpose(0, 1)?)?;
    Ok(())
}

/// The size of a projection's output for input `x` (…, in): (…, out).
pub(crate) fn output_size(x: &Tensor, out: i64) -> Vec<i64> {
    let mut size = x.size();
    if let Some(last) = size.last_mut() {
        *last = out;
    }
    size
}

/// PEFT's init of `lora_A` (r, in), kaiming-uniform: U(−1/√in, 1/√in), f32 on the CPU. The
/// numbers come from a generator seeded by the variable's name, not from libtorch's global one,
/// so every data-parallel replica and every run starts from the same adapters.
fn lora_a_init(name: &str, rank: i64, in_dim: i64) -> TchResult<Tensor> {
    // FNV-1a of the name seeds SplitMix64; the top 24 bits of each draw give a uniform in [0, 1).
    let mut state =
        name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let bound = 1.0 / (in_dim as f64).sqrt();
    let values: Vec<f32> = (0..rank * in_dim)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            let unit = ((z ^ (z >> 31)) >> 40) as f64 / (1u64 << 24) as f64;
            ((2.0 * unit - 1.0) * bound) as f32
        })
        .collect();
    Tensor::f_from_slice(&values)?.f_view([rank, in_dim])
}

/// RMSNorm: `weight · x / sqrt(mean(x²) + eps)`, statistics in f32 as HF computes them.
#[derive(Debug)]
pub(crate) struct RmsNorm {
    pub(crate) weight: Tensor,
    pub(crate) eps: f64,
}

impl RmsNorm {
    /// Creates `path/weight` of width `dim`.
    pub(crate) fn new(path: nn::Path<'_>, dim: i64, eps: f64, init: &Init) -> TchResult<Self> {
        Ok(Self { weight: init.weight(&path, "weight", &[dim], true)?, eps })
    }

    /// Normalizes over the last dimension. On CUDA this is libtorch's fused kernel (one pass
    /// forward, one backward, f32 accumulation, no f32 copies of `x` kept for backward); elsewhere
    /// its composite of the same formula. HF rounds the normalized value to the input dtype
    /// before scaling by `weight`; the fused kernel rounds once at the end (equal in f32, within
    /// one bf16 rounding in bf16).
    pub(crate) fn forward(&self, x: &Tensor) -> TchResult<Tensor> {
        let width = self.weight.size()[0];
        Ok(x.f_internal_fused_rms_norm([width], Some(&self.weight), self.eps)?.0)
    }
}

/// Rotary position embeddings with HF's `rotate_half` layout (first half, second half).
#[derive(Debug)]
pub(crate) struct RotaryEmbedding {
    /// (head_dim / 2,) f32
    inv_freq: Tensor,
    /// (head_dim, head_dim) in the model dtype: `x · rotate = rotate_half(x)`.
    rotate: Tensor,
}

impl RotaryEmbedding {
    /// Frequencies for `cfg`, computed in f32 the way transformers does (incl. llama3 scaling),
    /// and the `rotate_half` matrix in `kind`, the model dtype.
    pub(crate) fn new(cfg: &HfConfig, device: Device, kind: Kind) -> TchResult<Self> {
        let dim = cfg.head_dim();
        let exponents = Tensor::f_arange_start_step(0, dim, 2, (Kind::Int64, device))?
            .f_to_kind(Kind::Float)?
            .f_div_scalar(dim as f64)?;
        let inv_freq = Tensor::f_pow_scalar(cfg.rope_theta(), &exponents)?.f_reciprocal()?;
        let inv_freq = match cfg.rope_kind() {
            Ok(RopeKind::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }) => {
                llama3_scaled(&inv_freq, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)?
            }
            _ => inv_freq,
        };
        Ok(Self { inv_freq, rotate: rotate_half_matrix(dim, kind, device)? })
    }

    /// The tables of one forward pass over `position_ids` (B, L), in `kind`, for attention with
    /// `heads` query heads and `kv_heads` key heads. With `fused` the layers run the fused
    /// kernels (`model::fused_ops`), which read cos and sin per token, and the per-head tables
    /// are not made.
    pub(crate) fn tables(
        &self,
        position_ids: &Tensor,
        kind: Kind,
        (heads, kv_heads): (i64, i64),
        fused: bool,
    ) -> TchResult<RopeTables> {
        // (B, L, 1) * (D/2) -> (B, L, D/2) -> (B, L, 1, D)
        let freqs = position_ids.f_to_kind(Kind::Float)?.f_unsqueeze(-1)?.f_mul(&self.inv_freq)?;
        let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?.f_unsqueeze(2)?;
        let (cos, sin) = (emb.f_cos()?.f_to_kind(kind)?, emb.f_sin()?.f_to_kind(kind)?);
        let mut per_head_count = Vec::new();
        for n in [heads, kv_heads] {
            if !fused && per_head_count.iter().all(|(m, _, _)| *m != n) {
                let (b, l, d) = (cos.size()[0], cos.size()[1], cos.size()[3]);
                let expand = |t: &Tensor| t.f_expand([b, l, n, d], false)?.f_contiguous();
                per_head_count.push((n, expand(&cos)?, expand(&sin)?));
            }
        }
        let d = cos.size()[3];
        let per_token = (cos.f_reshape([-1, d])?, sin.f_reshape([-1, d])?);
        Ok(RopeTables { per_head_count, per_token, rotate: self.rotate.shallow_clone(), fused })
    }
}

/// cos and sin of one forward pass laid out as (B, L, heads, D), one pair per head count (query
/// and key heads), materialized so that every product below is one contiguous, vectorized pass;
/// `rotate`, the (D, D) signed permutation with `x · rotate = rotate_half(x)`; and, for the
/// fused kernels, cos and sin per token (B·L, D) and whether the layers use those kernels.
#[derive(Debug)]
pub(crate) struct RopeTables {
    per_head_count: Vec<(i64, Tensor, Tensor)>,
    per_token: (Tensor, Tensor),
    rotate: Tensor,
    fused: bool,
}

impl RopeTables {
    /// Whether this forward runs the fused q/k/v and SwiGLU ops.
    pub(crate) fn fused(&self) -> bool {
        self.fused
    }

    /// (B·L, D) cos and sin, contiguous.
    pub(crate) fn per_token(&self) -> (&Tensor, &Tensor) {
        (&self.per_token.0, &self.per_token.1)
    }

    /// HF's `x * cos + rotate_half(x) * sin` for x (B, L, heads, D). `rotate_half`
    /// (−x₂, x₁) is a small GEMM with an exact ±1 permutation (one term per output), which reads
    /// `x` once and needs no contiguous copy, unlike `cat`/`narrow` or `roll`; its backward is
    /// the transposed GEMM.
    pub(crate) fn apply(&self, x: &Tensor) -> TchResult<Tensor> {
        let heads = x.size()[2];
        let (_, cos, sin) = self
            .per_head_count
            .iter()
            .find(|(n, _, _)| *n == heads)
            .ok_or_else(|| TchError::Shape(format!("no rotary table for {heads} heads")))?;
        x.f_mul(cos)?.f_addcmul(&x.f_matmul(&self.rotate)?, sin)
    }
}

/// (D, D) with `x · R = (−x[D/2..], x[..D/2])`.
fn rotate_half_matrix(dim: i64, kind: Kind, device: Device) -> TchResult<Tensor> {
    let half = dim / 2;
    let mut values = vec![0f32; (dim * dim) as usize];
    for j in 0..half {
        values[((j + half) * dim + j) as usize] = -1.0; // out[j] = −x[j + D/2]
        values[(j * dim + j + half) as usize] = 1.0; // out[j + D/2] = x[j]
    }
    Tensor::f_from_slice(&values)?.f_view([dim, dim])?.f_to_device_(device, kind, false, false)
}

/// transformers' `_compute_llama3_parameters`, on f32 tensors.
fn llama3_scaled(inv_freq: &Tensor, factor: f64, low: f64, high: f64, original: f64) -> TchResult<Tensor> {
    let low_freq_wavelen = original / low;
    let high_freq_wavelen = original / high;
    let wavelen = inv_freq.f_reciprocal()?.f_mul_scalar(2.0 * std::f64::consts::PI)?;
    let divided = inv_freq.f_div_scalar(factor)?;
    let scaled = divided.f_where_self(&wavelen.f_gt(low_freq_wavelen)?, inv_freq)?;
    let smooth = wavelen.f_reciprocal()?.f_mul_scalar(original)?.f_sub_scalar(low)?.f_div_scalar(high - low)?;
    // (1 - smooth) * scaled / factor + smooth * scaled
    let smoothed =
        smooth.f_neg()?.f_add_scalar(1.0)?.f_mul(&scaled)?.f_div_scalar(factor)?.f_add(&smooth.f_mul(&scaled)?)?;
    let medium = wavelen.f_ge(high_freq_wavelen)?.f_logical_and(&wavelen.f_le(low_freq_wavelen)?)?;
    smoothed.f_where_self(&medium, &scaled)
}
