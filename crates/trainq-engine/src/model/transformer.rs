//! The decoder-only transformer (Qwen3, Qwen2, Llama): one struct per HF submodule, Rust field
//! names equal to checkpoint keys, packed documents kept apart in attention ([`DocumentLayout`]).

use tch::{nn, Device, Kind, Tensor};

use super::cudnn_varlen::{cudnn_varlen, RaggedBatch};
use super::flash_varlen::{flash_varlen, CuSeqlens};
use super::fused_linear::FusedLinear;
use super::fused_ops::{add_rms_norm, add_rms_norm_fits, projection, qkv_norm_rope, swiglu, ProjectionInput, QkvSpec};
use super::hf_config::{Architecture, HfConfig};
use super::layers::{output_size, Init, Linear, LoraSpec, RmsNorm, RopeTables, RotaryEmbedding, TchResult};

/// `self_attn`: GQA with RoPE, per-head q/k RMSNorm on Qwen3. `q_proj`, `k_proj` and `v_proj`
/// run as one projection (`qkv`).
#[derive(Debug)]
pub(crate) struct Attention {
    qkv: FusedLinear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    num_heads: i64,
    num_kv_heads: i64,
    head_dim: i64,
}

impl Attention {
    fn new(path: nn::Path<'_>, cfg: &HfConfig, init: &Init, lora: Option<&LoraSpec>) -> TchResult<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim());
        let (heads, kv) = (cfg.num_attention_heads, cfg.num_kv_heads());
        let qkv_bias = cfg.qkv_bias();
        let qwen3 = cfg.architecture() == Architecture::Qwen3;
        let norm = |name: &str| RmsNorm::new(&path / name, d, cfg.rms_norm_eps, init);
        let members = vec![
            Linear::new(&path / "q_proj", h, heads * d, qkv_bias, init, lora)?,
            Linear::new(&path / "k_proj", h, kv * d, qkv_bias, init, lora)?,
            Linear::new(&path / "v_proj", h, kv * d, qkv_bias, init, lora)?,
        ];
        Ok(Self {
            qkv: FusedLinear::new(members, !init.base_trainable)?,
            o_proj: Linear::new(&path / "o_proj", heads * d, h, cfg.o_bias(), init, lora)?,
            q_norm: if qwen3 { Some(norm("q_norm")?) } else { None },
            k_norm: if qwen3 { Some(norm("k_norm")?) } else { None },
            num_heads: heads,
            num_kv_heads: kv,
            head_dim: d,
        })
    }

    /// (B, L, hidden) -> q (B, L, H, D), k and v (B, L, KV, D): one projection, then q and k
    /// normed per head (Qwen3) and rotated, by the fused op when the forward uses it.
    fn project(&self, x: &Tensor, rope: &RopeTables) -> TchResult<(Tensor, Tensor, Tensor)> {
        let (b, l) = (x.size()[0], x.size()[1]);
        let (h, kv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        // (B, L, hidden) -> (B, L, (H + 2·KV)·D)
        let qkv = self.qkv.forward(x, rope.fused())?;
        if rope.fused() {
            let norms = match (&self.q_norm, &self.k_norm) {
                (Some(q), Some(k)) => Some((&q.weight, &k.weight)),
                _ => None,
            };
            let eps = self.q_norm.as_ref().map_or(1e-6, |n| n.eps);
            let spec = QkvSpec { norms, cos_sin: rope.per_token(), heads: h, kv_heads: kv, eps };
            // (B·L, (H + 2·KV)·D) -> (B·L, n, D) each, then (B, L, n, D)
            let (q, k, v) = qkv_norm_rope(&qkv.f_reshape([b * l, (h + 2 * kv) * d])?, &spec)?;
            return Ok((q.f_view([b, l, h, d])?, k.f_view([b, l, kv, d])?, v.f_view([b, l, kv, d])?));
        }
        let parts = qkv.f_split_with_sizes([h * d, kv * d, kv * d], -1)?;
        // (B, L, n·D) -> (B, L, n, D), normed per head and rotated in this layout
        let heads = |t: &Tensor, n: i64, norm: &Option<RmsNorm>| -> TchResult<Tensor> {
            let t = t.f_view([b, l, n, d])?;
            match norm {
                Some(norm) => norm.forward(&t),
                None => Ok(t),
            }
        };
        let q = rope.apply(&heads(&parts[0], h, &self.q_norm)?)?;
        let k = rope.apply(&heads(&parts[1], kv, &self.k_norm)?)?;
        Ok((q, k, heads(&parts[2], kv, &None)?))
    }

    /// (B, L, hidden) -> (B, L, hidden), documents kept apart as `layout` says.
    fn forward(&self, x: &Tensor, rope: &RopeTables, layout: &DocumentLayout) -> TchResult<Tensor> {
        let (b, l) = (x.size()[0], x.size()[1]);
        let (q, k, v) = self.project(x, rope)?;
        let gqa = self.num_heads != self.num_kv_heads;
        let mask = match layout {
            DocumentLayout::Causal => None,
            DocumentLayout::Mask(mask) => Some(mask),
            DocumentLayout::Segments { lengths, flash, cudnn } => {
                let y = match flash {
                    // (B, L, n, D) -> (B·L, n, D): one varlen kernel over every document
                    Some(cu) => {
                        let q = q.f_reshape([b * l, self.num_heads, self.head_dim])?;
                        let k = k.f_reshape([b * l, self.num_kv_heads, self.head_dim])?;
                        let v = v.f_reshape([b * l, self.num_kv_heads, self.head_dim])?;
                        match cudnn.as_ref().filter(|_| !super::cudnn_varlen::declined()) {
                            Some(batch) => cudnn_varlen(&q, &k, &v, batch).or_else(|error| {
                                super::cudnn_varlen::decline(&error);
                                flash_varlen(&q, &k, &v, cu)
                            })?,
                            None => flash_varlen(&q, &k, &v, cu)?,
                        }
                    }
                    None => segment_attention(&q, &k, &v, lengths, gqa)?,
                };
                return self.o_proj.forward(&y.f_reshape([b, l, self.num_heads * self.head_dim])?, rope.fused());
            }
        };
        // (B, L, n, D) -> (B, n, L, D)
        let (q, k, v) = (q.f_transpose(1, 2)?, k.f_transpose(1, 2)?, v.f_transpose(1, 2)?);
        // With a mask, CUDA's memory-efficient kernel takes no GQA: repeat k/v to every head
        // (B, KV, L, D) -> (B, H, L, D); without one, flash attention handles GQA itself.
        let (k, v, gqa) = match mask {
            Some(_) if gqa => {
                let groups = self.num_heads / self.num_kv_heads;
                (
                    k.f_repeat_interleave_self_int(groups, 1, None)?,
                    v.f_repeat_interleave_self_int(groups, 1, None)?,
                    false,
                )
            }
            _ => (k, v, gqa),
        };
        let y = Tensor::f_scaled_dot_product_attention(&q, &k, &v, mask, 0.0, mask.is_none(), None, gqa)?;
        // (B, H, L, D) -> (B, L, H*D)
        let y = y.f_transpose(1, 2)?.f_reshape([b, l, self.num_heads * self.head_dim])?;
        self.o_proj.forward(&y, rope.fused())
    }
}

/// `mlp`: SwiGLU, `down(silu(gate(x)) * up(x))`; `gate_proj` and `up_proj` run as one
/// projection (`gate_up`).
#[derive(Debug)]
pub(crate) struct Mlp {
    gate_up: FusedLinear,
    down_proj: Linear,
    intermediate: i64,
}

impl Mlp {
    fn new(path: nn::Path<'_>, cfg: &HfConfig, init: &Init, lora: Option<&LoraSpec>) -> TchResult<Self> {
        let (h, i, bias) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias());
        let members = vec![
            Linear::new(&path / "gate_proj", h, i, bias, init, lora)?,
            Linear::new(&path / "up_proj", h, i, bias, init, lora)?,
        ];
        Ok(Self {
            gate_up: FusedLinear::new(members, !init.base_trainable)?,
            down_proj: Linear::new(&path / "down_proj", i, h, bias, init, lora)?,
            intermediate: i,
        })
    }

    /// (B, L, hidden) -> (B, L, hidden); with `fused`, SwiGLU is one op of ours, and with frozen
    /// weights (LoRA) one op with the down projection that keeps the gate/up output and, if
    /// `keep_product`, `silu(gate) · up` as well (else the backward computes it again).
    fn forward(&self, x: &Tensor, fused: bool, keep_product: bool) -> TchResult<Tensor> {
        // (B, L, hidden) -> (B, L, 2·I): gate, then up
        let gate_up = self.gate_up.forward(x, fused)?;
        let i = self.intermediate;
        if !fused {
            let parts = gate_up.f_split(i, -1)?;
            return self.down_proj.forward(&parts[0].f_silu()?.f_mul(&parts[1])?, false);
        }
        let (b, l) = (x.size()[0], x.size()[1]);
        let rows = gate_up.f_reshape([b * l, 2 * i])?;
        let down = &self.down_proj;
        if down.weight.requires_grad() {
            return down.forward(&swiglu(&rows)?.f_view([b, l, i])?, true);
        }
        let input = if keep_product { ProjectionInput::SwiGluKept } else { ProjectionInput::SwiGluRecomputed };
        let y = projection(&rows, &down.weight, down.bias.as_ref(), down.adapter().as_ref(), input)?;
        y.f_view(output_size(x, down.weight.size()[0]).as_slice())
    }
}

/// `model.layers.N`: pre-norm attention and MLP blocks with residuals.
#[derive(Debug)]
pub(crate) struct DecoderLayer {
    self_attn: Attention,
    mlp: Mlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    fn new(path: nn::Path<'_>, cfg: &HfConfig, init: &Init, lora: Option<&LoraSpec>) -> TchResult<Self> {
        let eps = cfg.rms_norm_eps;
        Ok(Self {
            self_attn: Attention::new(&path / "self_attn", cfg, init, lora)?,
            mlp: Mlp::new(&path / "mlp", cfg, init, lora)?,
            input_layernorm: RmsNorm::new(&path / "input_layernorm", cfg.hidden_size, eps, init)?,
            post_attention_layernorm: RmsNorm::new(&path / "post_attention_layernorm", cfg.hidden_size, eps, init)?,
        })
    }

    /// Layer by layer (activation checkpointing recomputes one at a time): (B, L, hidden) ->
    /// (B, L, hidden). Only one layer's activations live at a time here, so the MLP keeps its
    /// SwiGLU product rather than computing it again in the backward.
    pub(super) fn forward(&self, x: &Tensor, rope: &RopeTables, layout: &DocumentLayout) -> TchResult<Tensor> {
        let (x, mlp) = self.blocks(x, &self.input_layernorm.forward(x)?, rope, layout, true)?;
        x.f_add(&mlp)
    }

    /// The attention and MLP blocks from the residual stream `x` and its input norm `normed`:
    /// returns the stream after attention and the MLP's output, whose sum is the layer's output.
    /// The sum is left to the caller, which runs it with the next norm as one op.
    /// `keep_mlp_product`: see [`Mlp::forward`].
    fn blocks(
        &self,
        x: &Tensor,
        normed: &Tensor,
        rope: &RopeTables,
        layout: &DocumentLayout,
        keep_mlp_product: bool,
    ) -> TchResult<(Tensor, Tensor)> {
        let attn = self.self_attn.forward(normed, rope, layout)?;
        let (x, normed) = add_then_norm(x, &attn, &self.post_attention_layernorm, rope.fused())?;
        let mlp = self.mlp.forward(&normed, rope.fused(), keep_mlp_product)?;
        Ok((x, mlp))
    }
}

/// x, h (B, L, hidden) -> (x + h, norm(x + h)): with `fused` (and a width the kernels take) one
/// fused op each way, else the add, then the norm.
fn add_then_norm(x: &Tensor, h: &Tensor, norm: &RmsNorm, fused: bool) -> TchResult<(Tensor, Tensor)> {
    let width = norm.weight.size()[0];
    if fused && add_rms_norm_fits(width) {
        // (B, L, hidden) -> (B·L, hidden) and back
        let size = x.size();
        let rows = |t: &Tensor| t.f_reshape([-1, width]);
        let (sum, normed) = add_rms_norm(&rows(x)?, &rows(h)?, &norm.weight, norm.eps)?;
        return Ok((sum.f_view(size.as_slice())?, normed.f_view(size.as_slice())?));
    }
    let sum = x.f_add(h)?;
    let normed = norm.forward(&sum)?;
    Ok((sum, normed))
}

/// `model` plus `lm_head`: embeddings, decoder layers, final norm, output projection.
#[derive(Debug)]
pub(crate) struct CausalLm {
    pub(super) embed_tokens: Tensor,
    pub(super) layers: Vec<DecoderLayer>,
    pub(super) norm: RmsNorm,
    pub(super) rotary: RotaryEmbedding,
    /// (vocab, hidden); the same tensor as `embed_tokens` when embeddings are tied.
    pub(crate) lm_head: Tensor,
    /// Whether forwards on CUDA in bf16 run the fused q/k/v and SwiGLU ops (`model::fused_ops`).
    pub(crate) fused_ops: bool,
    /// Whether a LoRA layer's fused MLP keeps its SwiGLU product for the backward (faster, one
    /// (tokens, intermediate) tensor a layer more) instead of computing it again.
    pub(crate) keep_mlp_activations: bool,
}

impl CausalLm {
    /// Creates every variable under `root` with HF's names (`model.layers.0.self_attn.q_proj.weight`…).
    pub(crate) fn new(root: &nn::Path<'_>, cfg: &HfConfig, init: &Init, lora: Option<&LoraSpec>) -> TchResult<Self> {
        let model = root / "model";
        let embed_tokens =
            init.weight(&(&model / "embed_tokens"), "weight", &[cfg.vocab_size, cfg.hidden_size], false)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::new(&model / "layers" / i, cfg, init, lora))
            .collect::<TchResult<Vec<_>>>()?;
        let norm = RmsNorm::new(&model / "norm", cfg.hidden_size, cfg.rms_norm_eps, init)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed_tokens.shallow_clone()
        } else {
            init.weight(&(root / "lm_head"), "weight", &[cfg.vocab_size, cfg.hidden_size], false)?
        };
        let rotary = RotaryEmbedding::new(cfg, root.device(), init.kind)?;
        Ok(Self { embed_tokens, layers, norm, rotary, lm_head, fused_ops: true, keep_mlp_activations: false })
    }

    /// Final hidden states (B, L, hidden) after the last norm, for `input_ids` and
    /// `position_ids` (B, L); documents are kept apart as `layout` says.
    pub(crate) fn hidden_states(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        layout: &DocumentLayout,
    ) -> TchResult<Tensor> {
        let mut x = Tensor::f_embedding(&self.embed_tokens, input_ids, -1, false, false)?;
        let rope = self.rope_tables(position_ids, x.kind())?;
        // A layer's last residual add runs with the norm after it (the next layer's input norm,
        // or the final norm) as one op: the MLP's output waits in `pending` until then.
        let mut pending: Option<Tensor> = None;
        for layer in &self.layers {
            let normed = match pending.take() {
                Some(mlp) => {
                    let (sum, normed) = add_then_norm(&x, &mlp, &layer.input_layernorm, rope.fused())?;
                    x = sum;
                    normed
                }
                None => layer.input_layernorm.forward(&x)?,
            };
            let (stream, mlp) = layer.blocks(&x, &normed, &rope, layout, self.keep_mlp_activations)?;
            x = stream;
            pending = Some(mlp);
        }
        match pending {
            Some(mlp) => Ok(add_then_norm(&x, &mlp, &self.norm, rope.fused())?.1),
            None => self.norm.forward(&x),
        }
    }
}

impl CausalLm {
    /// The rotary tables of a forward pass over `position_ids`, for this model's head counts;
    /// they also say whether the layers run the fused ops ([`CausalLm::fused_ops_active`]).
    pub(super) fn rope_tables(&self, position_ids: &Tensor, kind: Kind) -> TchResult<RopeTables> {
        let (heads, kv_heads) =
            self.layers.first().map_or((1, 1), |l| (l.self_attn.num_heads, l.self_attn.num_kv_heads));
        let fused = self.fused_ops_active(position_ids.device(), kind);
        self.rotary.tables(position_ids, kind, (heads, kv_heads), fused)
    }

    /// Whether forwards on `device` in `kind` run the fused q/k/v and SwiGLU ops: switched on,
    /// available there (CUDA, bf16, kernels compiled) and a head dim and width the kernels take.
    pub(crate) fn fused_ops_active(&self, device: Device, kind: Kind) -> bool {
        let shape_fits = self
            .layers
            .first()
            .is_some_and(|l| matches!(l.self_attn.head_dim, 64 | 128 | 256) && l.mlp.intermediate % 8 == 0);
        self.fused_ops && shape_fits && super::fused_ops::available(device, kind)
    }
}

/// How packed documents are kept apart in attention. A document starts where `position_ids`
/// is 0; padding at the end of a row is a document of its own (its outputs are never trained).
#[derive(Debug)]
pub(crate) enum DocumentLayout {
    /// Every row holds one document: plain causal attention on the fastest kernels.
    Causal,
    /// Rows hold several documents: causal attention per segment, with no L×L mask and with
    /// GQA kept native. `lengths` are the segments in row-major order (they sum to B·L); on
    /// CUDA in bf16 one ragged kernel covers them all (cuDNN's with `cudnn`, else flash varlen
    /// with `flash`), elsewhere one call of the causal kernel per segment.
    Segments {
        /// Segment lengths, row by row.
        lengths: Vec<i64>,
        /// Their cumulative starts on the device, for the varlen flash kernel.
        flash: Option<CuSeqlens>,
        /// The documents for cuDNN's ragged kernel (tried first; flash varlen if cuDNN declines).
        cudnn: Option<RaggedBatch>,
    },
    /// The dense (B, 1, L, L) document mask with K/V repeated to every head: the reference
    /// the segment path is tested against, and what `bench check` compares.
    Mask(Tensor),
}

/// Which packed-attention path a policy uses for rows that hold several documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PackedAttention {
    /// Causal attention per document segment (no mask; native GQA): cuDNN's ragged kernel on
    /// CUDA in bf16 (variable-length flash attention where cuDNN declines), one kernel call per
    /// segment elsewhere. The default.
    #[default]
    Segments,
    /// As `Segments` with variable-length flash attention, never cuDNN (for comparisons).
    FlashVarlen,
    /// One kernel call per segment everywhere (the fallback path, for comparisons).
    SegmentLoop,
    /// The dense (B, 1, L, L) mask (the reference path).
    DenseMask,
}

/// Which kernel the default packed path (`PackedAttention::Segments`) runs on `device` in
/// `kind` as things stand: "cudnn" (built, and not declined in this process), "flash_varlen"
/// or "segment_loop".
pub fn packed_attention_kernel(device: Device, kind: Kind) -> &'static str {
    let ragged = device.is_cuda() && matches!(kind, Kind::BFloat16 | Kind::Half);
    if ragged && cfg!(trainq_cudnn_varlen) && !super::cudnn_varlen::declined() {
        "cudnn"
    } else if ragged && cfg!(trainq_flash_varlen) {
        "flash_varlen"
    } else {
        "segment_loop"
    }
}

impl DocumentLayout {
    /// The layout of a batch from its segment lengths read on the host (`None`: read
    /// `position_ids` from the device, a sync).
    pub(crate) fn of(
        position_ids: &Tensor,
        segments: Option<&[i64]>,
        packed: PackedAttention,
        kind: Kind,
    ) -> TchResult<Self> {
        let (rows, cols) = position_ids.size2()?;
        let owned;
        let lengths = match segments {
            Some(lengths) => lengths,
            None => {
                let host = Vec::<i64>::try_from(&position_ids.f_reshape([rows * cols])?.f_to(Device::Cpu)?)?;
                owned = segment_lengths(&host, cols as usize);
                &owned
            }
        };
        if lengths.len() as i64 <= rows {
            return Ok(DocumentLayout::Causal);
        }
        Ok(match packed {
            PackedAttention::Segments | PackedAttention::FlashVarlen => {
                let flash = CuSeqlens::new(lengths, position_ids.device(), kind)?;
                let cudnn = (packed == PackedAttention::Segments && flash.is_some())
                    .then(|| RaggedBatch::new(lengths, position_ids.device(), kind))
                    .flatten();
                DocumentLayout::Segments { lengths: lengths.to_vec(), flash, cudnn }
            }
            PackedAttention::SegmentLoop => {
                DocumentLayout::Segments { lengths: lengths.to_vec(), flash: None, cudnn: None }
            }
            PackedAttention::DenseMask => DocumentLayout::Mask(document_mask(position_ids)?),
        })
    }
}

/// The lengths of the documents (and padding runs) of row-major `position_ids` with rows of
/// `cols`: a segment starts at each row's first column and wherever the position is 0.
pub fn segment_lengths(position_ids: &[i64], cols: usize) -> Vec<i64> {
    let mut lengths = Vec::new();
    let mut current = 0i64;
    for (i, &p) in position_ids.iter().enumerate() {
        if (i % cols.max(1) == 0 || p == 0) && current > 0 {
            lengths.push(current);
            current = 0;
        }
        current += 1;
    }
    if current > 0 {
        lengths.push(current);
    }
    lengths
}

/// Causal attention within each segment of the flattened (B·L) token axis: q (B, L, H, D) and
/// k, v (B, L, KV, D), contiguous; returns (B·L, H, D). One `split_with_sizes` and one `cat`
/// (their backward passes are a `cat` and a split), and per segment the mask-free causal kernel
/// with GQA left to the kernel (`enable_gqa`), so K/V are never repeated.
fn segment_attention(q: &Tensor, k: &Tensor, v: &Tensor, lengths: &[i64], gqa: bool) -> TchResult<Tensor> {
    let (b, l, heads, d) = q.size4()?;
    let kv = k.size()[2];
    // (B, L, n, D) -> (B·L, n, D), then one piece per segment
    let pieces =
        |t: &Tensor, n: i64| -> TchResult<Vec<Tensor>> { t.f_reshape([b * l, n, d])?.f_split_with_sizes(lengths, 0) };
    let (qs, ks, vs) = (pieces(q, heads)?, pieces(k, kv)?, pieces(v, kv)?);
    let mut outs = Vec::with_capacity(lengths.len());
    for ((q, k), v) in qs.iter().zip(&ks).zip(&vs) {
        // (S, n, D) -> (1, n, S, D)
        let view = |t: &Tensor| -> TchResult<Tensor> { t.f_unsqueeze(0)?.f_transpose(1, 2) };
        let y = Tensor::f_scaled_dot_product_attention(
            &view(q)?,
            &view(k)?,
            &view(v)?,
            None::<&Tensor>,
            0.0,
            true,
            None,
            gqa,
        )?;
        // (1, H, S, D) -> (S, H, D)
        outs.push(y.f_squeeze_dim(0)?.f_transpose(0, 1)?);
    }
    Tensor::f_cat(&outs, 0)
}

/// The attention mask (B, 1, L, L) for packed rows: token i attends to j iff j ≤ i and both lie
/// in the same document (documents start where `position_ids` is 0).
pub(crate) fn document_mask(position_ids: &Tensor) -> TchResult<Tensor> {
    let l = position_ids.size()[1];
    let starts = position_ids.f_eq(0)?;
    // (B, L) document index of each token
    let doc = starts.f_cumsum(1, Kind::Int64)?;
    // (B, L, 1) == (B, 1, L) -> (B, L, L)
    let same = doc.f_unsqueeze(2)?.f_eq_tensor(&doc.f_unsqueeze(1)?)?;
    let causal = Tensor::f_ones([l, l], (Kind::Bool, position_ids.device()))?.f_tril(0)?;
    same.f_logical_and(&causal)?.f_unsqueeze(1)
}

#[cfg(test)]
mod tests {
    use super::segment_lengths;

    #[test]
    fn segments_start_at_each_row_and_at_each_position_zero() {
        // Row 0: documents of 3 and 2; row 1: one of 4 then one padding token.
        let positions = [0, 1, 2, 0, 1, 0, 1, 2, 3, 0];
        assert_eq!(segment_lengths(&positions, 5), vec![3, 2, 4, 1]);
        // Two unpacked rows: one segment each.
        assert_eq!(segment_lengths(&[0, 1, 2, 0, 1, 2], 3), vec![3, 3]);
        assert!(segment_lengths(&[], 4).is_empty());
    }
}
