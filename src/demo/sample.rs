//! The demo's own generation: temperature-1 sampling of a batch of completions for one prompt,
//! keeping each sampled token's log-probability (the sampler log-probs the trainer's importance
//! ratio is formed against).

use rand::distributions::{Distribution, WeightedIndex};
use rand::Rng;
use tch::{Kind, Tensor};

use crate::error::Result;
use trainq_engine::Error as EngineError;

/// One sampled completion: its token ids (ending with EOS when it stopped) and their log-probs.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// Completion token ids, without the prompt.
    pub ids: Vec<i64>,
    /// `log p(ids[i] | prompt, ids[..i])` under the sampling policy.
    pub logprobs: Vec<f32>,
}

/// Samples `n` completions of `prompt` of at most `max_new_tokens`, stopping each at `eos`.
///
/// `last_logits` maps a `[n, L]` batch of ids to the logits of the next token, `[n, vocab]`.
/// Sequences are recomputed from the start each token (no KV cache): fine for the demo's tiny
/// model and short answers.
pub fn sample_completions(
    mut last_logits: impl FnMut(&Tensor) -> Result<Tensor>,
    prompt: &[i64],
    n: usize,
    max_new_tokens: usize,
    eos: i64,
    rng: &mut impl Rng,
) -> Result<Vec<Sampled>> {
    let mut rows: Vec<Vec<i64>> = vec![prompt.to_vec(); n];
    let mut out: Vec<Sampled> = vec![Sampled { ids: vec![], logprobs: vec![] }; n];
    let mut done = vec![false; n];
    for _ in 0..max_new_tokens {
        if done.iter().all(|d| *d) {
            break;
        }
        let flat: Vec<i64> = rows.iter().flatten().copied().collect();
        let batch = Tensor::from_slice(&flat).view([n as i64, rows[0].len() as i64]);
        let logp = last_logits(&batch)?.to_kind(Kind::Float).log_softmax(-1, Kind::Float).to_device(tch::Device::Cpu);
        let logp: Vec<Vec<f32>> =
            Vec::<Vec<f32>>::try_from(&logp).map_err(EngineError::torch("read sampler log-probs"))?;
        for (i, row_logp) in logp.iter().enumerate() {
            // Finished rows keep growing with EOS so the batch stays rectangular; ignored.
            let token = if done[i] { eos } else { draw(row_logp, rng)? };
            rows[i].push(token);
            if !done[i] {
                out[i].ids.push(token);
                out[i].logprobs.push(row_logp[token as usize]);
                done[i] = token == eos;
            }
        }
    }
    Ok(out)
}

fn draw(logp: &[f32], rng: &mut impl Rng) -> Result<i64> {
    let weights = logp.iter().map(|l| l.exp());
    let dist = WeightedIndex::new(weights).map_err(|e| EngineError::Tokenize(format!("sampling weights: {e}")))?;
    Ok(dist.sample(rng) as i64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn a_policy_that_always_says_eos_stops_after_one_token() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let logits = |b: &Tensor| {
            let n = b.size()[0];
            let l = Tensor::full([n, 5], -1e9, (Kind::Float, tch::Device::Cpu));
            let _ = l.narrow(1, 2, 1).fill_(0.0);
            Ok(l)
        };
        let out = sample_completions(logits, &[1, 3], 3, 10, 2, &mut rng).unwrap();
        assert_eq!(out.len(), 3);
        for s in out {
            assert_eq!(s.ids, vec![2]);
            assert!(s.logprobs[0].abs() < 1e-6);
        }
    }

    #[test]
    fn logprobs_are_those_of_the_sampled_tokens() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        // Two tokens, p = (0.25, 0.75), never EOS (id 9 out of range of the draw).
        let logits = |b: &Tensor| {
            let n = b.size()[0];
            Ok(Tensor::from_slice(&[0.25f32.ln(), 0.75f32.ln()]).view([1, 2]).repeat([n, 1]))
        };
        let out = sample_completions(logits, &[0], 4, 6, 9, &mut rng).unwrap();
        for s in &out {
            assert_eq!(s.ids.len(), 6);
            for (id, lp) in s.ids.iter().zip(&s.logprobs) {
                let expected = if *id == 0 { 0.25f32.ln() } else { 0.75f32.ln() };
                assert!((lp - expected).abs() < 1e-5);
            }
        }
    }
}
