//! Parameters laid out in flat buffers, so that the optimizer runs a few large kernels instead of
//! ~10 small ones per tensor (196 LoRA tensors on Qwen3-0.6B make the per-tensor loop launch bound).
//!
//! A [`FlatBucket`] owns one contiguous buffer per group of parameters of the same dtype and
//! device (at most [`BUCKET_ELEMENTS`] elements, or one larger tensor alone) and re-points each
//! member's storage into it with `set_data` (as `torch.nn.Module.flatten_parameters` does): the
//! variables keep their identity (the var store, tied weights and the model's layers see the
//! same tensors), and an in-place update of the buffer updates them all.

use tch::{Kind, Tensor};

use crate::error::{Error, Result};

/// Largest bucket: 32M elements (128 MiB of f32 per optimizer temporary).
pub const BUCKET_ELEMENTS: i64 = 1 << 25;

/// A group of parameters sharing one flat buffer.
#[derive(Debug)]
pub(crate) struct FlatBucket {
    /// Index of each member in the optimizer's parameter list.
    pub(crate) members: Vec<usize>,
    /// (offset, element count, shape) of each member in the buffer.
    spans: Vec<(i64, i64, Vec<i64>)>,
    /// Each member's slot address in the buffer, for [`FlatBucket::attach`]'s check.
    slots: Vec<usize>,
    /// The members' storage, in their dtype.
    pub(crate) values: Tensor,
}

impl FlatBucket {
    /// Groups `params` (in order) by dtype and device into buckets and moves their storage into
    /// each bucket's buffer (a copy, once).
    pub(crate) fn group(params: &[Tensor]) -> Result<Vec<FlatBucket>> {
        let mut groups: Vec<(Vec<usize>, i64)> = Vec::new();
        let mut open: Vec<(Kind, tch::Device, usize)> = Vec::new();
        for (i, p) in params.iter().enumerate() {
            let (kind, device, n) = (p.kind(), p.device(), p.numel() as i64);
            let slot = open.iter().position(|&(k, d, _)| k == kind && d == device);
            match slot {
                Some(s) if groups[open[s].2].1 + n <= BUCKET_ELEMENTS => {
                    let g = &mut groups[open[s].2];
                    g.0.push(i);
                    g.1 += n;
                }
                _ => {
                    groups.push((vec![i], n));
                    let entry = (kind, device, groups.len() - 1);
                    match slot {
                        Some(s) => open[s] = entry,
                        None => open.push(entry),
                    }
                }
            }
        }
        groups.into_iter().map(|(members, _)| Self::new(members, params)).collect()
    }

    fn new(members: Vec<usize>, params: &[Tensor]) -> Result<Self> {
        let mut spans = Vec::with_capacity(members.len());
        let mut offset = 0;
        for &i in &members {
            let n = params[i].numel() as i64;
            spans.push((offset, n, params[i].size()));
            offset += n;
        }
        let flat: Vec<Tensor> = members.iter().map(|&i| params[i].detach().reshape([-1])).collect();
        let values = tch::no_grad(|| Tensor::f_cat(&flat, 0)).map_err(Error::torch("flatten parameters"))?;
        let (base, item) = (values.data_ptr() as usize, values.kind().elt_size_in_bytes());
        let slots = spans.iter().map(|(offset, _, _)| base + *offset as usize * item).collect();
        let bucket = Self { members, spans, slots, values };
        bucket.attach(params)?;
        Ok(bucket)
    }

    /// The buffer's slice for member `j`, in the member's shape.
    pub(crate) fn view(&self, buffer: &Tensor, j: usize) -> Tensor {
        let (offset, n, shape) = &self.spans[j];
        buffer.narrow(0, *offset, *n).view(shape.as_slice())
    }

    /// Makes every member live in the buffer: one that was re-pointed elsewhere since (e.g.
    /// replaced by a load) has its current values copied in first. Host-side pointer checks
    /// only (no tensor op for a member already in place: this runs every step, hundreds of
    /// members).
    pub(crate) fn attach(&self, params: &[Tensor]) -> Result<()> {
        tch::no_grad(|| {
            for (j, &i) in self.members.iter().enumerate() {
                let p = &params[i];
                if p.data_ptr() as usize == self.slots[j] && p.size() == self.spans[j].2 {
                    continue;
                }
                let view = self.view(&self.values, j);
                if p.size() != view.size() || p.kind() != view.kind() || p.device() != view.device() {
                    let message = format!(
                        "parameter {i} is {:?} {:?}, its slot {:?} {:?}",
                        p.kind(),
                        p.size(),
                        view.kind(),
                        view.size()
                    );
                    return Err(Error::config("optimizer", message));
                }
                view.shallow_clone().f_copy_(p).map_err(Error::torch("copy a parameter into its bucket"))?;
                p.shallow_clone().f_set_data(&view).map_err(Error::torch("re-point a parameter to its bucket"))?;
            }
            Ok(())
        })
    }

    /// The members' gradients concatenated as one vector in the members' dtype (zeros where a
    /// member has none).
    pub(crate) fn gradient(&self, params: &[Tensor]) -> Result<Tensor> {
        let gather = || -> tch::Result<Tensor> {
            let grads = self
                .members
                .iter()
                .zip(&self.spans)
                .map(|(&i, (_, n, _))| {
                    let g = params[i].grad();
                    if g.defined() {
                        g.f_reshape([-1])
                    } else {
                        Tensor::f_zeros([*n], (params[i].kind(), params[i].device()))
                    }
                })
                .collect::<tch::Result<Vec<_>>>()?;
            Tensor::f_cat(&grads, 0)
        };
        tch::no_grad(gather).map_err(Error::torch("gather gradients"))
    }

    /// Total element count.
    pub(crate) fn numel(&self) -> i64 {
        self.spans.iter().map(|(_, n, _)| n).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn grouped_parameters_share_one_buffer_and_keep_their_values() {
        let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).reshape([2, 2]).set_requires_grad(true);
        let b = Tensor::from_slice(&[5.0f32]).set_requires_grad(true);
        let c = Tensor::from_slice(&[7i64]);
        let alias = a.shallow_clone();
        let buckets = FlatBucket::group(&[a.shallow_clone(), b.shallow_clone(), c.shallow_clone()]).unwrap();
        assert_eq!(buckets.len(), 2, "f32 and i64 apart");
        assert_eq!(buckets[0].members, vec![0, 1]);
        assert_eq!(Vec::<f32>::try_from(&buckets[0].values).unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(Vec::<f32>::try_from(alias.reshape([-1])).unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
        let _ = tch::no_grad(|| buckets[0].values.shallow_clone().fill_(0.5));
        assert_eq!(Vec::<f32>::try_from(alias.reshape([-1])).unwrap(), vec![0.5; 4]);
        assert!(a.requires_grad() && a.size() == vec![2, 2] && b.double_value(&[0]) == 0.5);
        assert_eq!(c.int64_value(&[0]), 7);
    }

    #[test]
    fn a_parameter_replaced_after_grouping_is_copied_back_in() {
        let mut a = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        let buckets = FlatBucket::group(&[a.shallow_clone()]).unwrap();
        tch::no_grad(|| a.set_data(&Tensor::from_slice(&[8.0f32, 9.0])));
        buckets[0].attach(&[a.shallow_clone()]).unwrap();
        assert_eq!(Vec::<f32>::try_from(&buckets[0].values).unwrap(), vec![8.0, 9.0]);
        assert_eq!(a.data_ptr(), buckets[0].values.data_ptr());
    }

    #[test]
    fn buckets_stop_at_the_element_cap() {
        let big = Tensor::zeros([BUCKET_ELEMENTS - 1], (Kind::Float, Device::Cpu));
        let small = Tensor::zeros([2], (Kind::Float, Device::Cpu));
        let buckets = FlatBucket::group(&[big, small.shallow_clone(), small]).unwrap();
        assert_eq!(buckets.iter().map(|b| b.members.clone()).collect::<Vec<_>>(), vec![vec![0], vec![1, 2]]);
    }
}
