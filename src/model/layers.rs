//! The building blocks of the transformer: linear projections with an optional LoRA adapter,
//! RMSNorm and rotary position embeddings, each mirroring its Hugging Face counterpart.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tch::{nn, Device, Kind, TchError, Tensor};

use super::hf_config::{HfConfig, RopeKind};

/// Results of libtorch calls inside the model; mapped to the crate error at the public API.
pub(crate) type TchResult<T> = std::result::Result<T, TchError>;

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
    pub(crate) fn weight(&self, path: &nn::Path, name: &str, dims: &[i64], ones: bool) -> TchResult<Tensor> {
        let options = (self.kind, path.device());
        let t = match (self.random, ones) {
            (false, _) => Tensor::f_empty(dims, options)?,
            (true, true) => Tensor::f_ones(dims, options)?,
            (true, false) => Tensor::f_randn(dims, options)?.f_mul_scalar(self.std)?,
        };
        Ok(path.add(name, t, self.base_trainable))
    }

    /// Adds a bias of `dims` (zeros when random).
    pub(crate) fn bias(&self, path: &nn::Path, dims: &[i64]) -> TchResult<Tensor> {
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
        path: nn::Path,
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
                let bound = 1.0 / (in_dim as f64).sqrt();
                let options = (init.kind, path.device());
                let a = Tensor::f_rand([spec.rank, in_dim], options)?.f_mul_scalar(2.0 * bound)?.f_sub_scalar(bound)?;
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

    /// (…, in) -> (…, out)
    pub(crate) fn forward(&self, x: &Tensor) -> TchResult<Tensor> {
        let y = x.f_linear(&self.weight, self.bias.as_ref())?;
        match &self.lora {
            Some(l) if l.enabled.load(Ordering::Relaxed) => {
                // (…, in) -> (…, r), scaled there where it is cheapest, -> (…, out)
                let low_rank = x.f_linear::<Tensor>(&l.lora_a, None)?.f_mul_scalar(l.scale)?;
                y.f_add(&low_rank.f_linear::<Tensor>(&l.lora_b, None)?)
            }
            _ => Ok(y),
        }
    }
}

/// RMSNorm as HF computes it: in f32, then cast back and scaled by `weight`.
#[derive(Debug)]
pub(crate) struct RmsNorm {
    pub(crate) weight: Tensor,
    pub(crate) eps: f64,
}

impl RmsNorm {
    /// Creates `path/weight` of width `dim`.
    pub(crate) fn new(path: nn::Path, dim: i64, eps: f64, init: &Init) -> TchResult<Self> {
        Ok(Self { weight: init.weight(&path, "weight", &[dim], true)?, eps })
    }

    /// Normalizes over the last dimension.
    pub(crate) fn forward(&self, x: &Tensor) -> TchResult<Tensor> {
        let kind = x.kind();
        let x32 = x.f_to_kind(Kind::Float)?;
        let variance = x32.f_pow_tensor_scalar(2)?.f_mean_dim(-1, true, Kind::Float)?;
        let normed = x32.f_mul(&variance.f_add_scalar(self.eps)?.f_rsqrt()?)?;
        self.weight.f_mul(&normed.f_to_kind(kind)?)
    }
}

/// Rotary position embeddings with HF's `rotate_half` layout (first half, second half).
#[derive(Debug)]
pub(crate) struct RotaryEmbedding {
    /// (head_dim / 2,) f32
    inv_freq: Tensor,
}

impl RotaryEmbedding {
    /// Frequencies for `cfg`, computed in f32 the way transformers does (incl. llama3 scaling).
    pub(crate) fn new(cfg: &HfConfig, device: Device) -> TchResult<Self> {
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
        Ok(Self { inv_freq })
    }

    /// cos and sin of shape (B, 1, L, head_dim) in `kind`, for `position_ids` (B, L).
    pub(crate) fn cos_sin(&self, position_ids: &Tensor, kind: Kind) -> TchResult<(Tensor, Tensor)> {
        // (B, L, 1) * (D/2) -> (B, L, D/2)
        let freqs = position_ids.f_to_kind(Kind::Float)?.f_unsqueeze(-1)?.f_mul(&self.inv_freq)?;
        let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?.f_unsqueeze(1)?;
        Ok((emb.f_cos()?.f_to_kind(kind)?, emb.f_sin()?.f_to_kind(kind)?))
    }
}

/// `x * cos + rotate_half(x) * sin` for x (B, H, L, D).
pub(crate) fn apply_rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> TchResult<Tensor> {
    let half = x.size()[3] / 2;
    let x1 = x.f_narrow(3, 0, half)?;
    let x2 = x.f_narrow(3, half, half)?;
    let rotated = Tensor::f_cat(&[&x2.f_neg()?, &x1], 3)?;
    x.f_mul(cos)?.f_add(&rotated.f_mul(sin)?)
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
    let smoothed = smooth.f_neg()?.f_add_scalar(1.0)?.f_mul(&scaled)?.f_div_scalar(factor)?.f_add(&smooth.f_mul(&scaled)?)?;
    let medium = wavelen.f_ge(high_freq_wavelen)?.f_logical_and(&wavelen.f_le(low_freq_wavelen)?)?;
    smoothed.f_where_self(&medium, &scaled)
}
