//! Gradient all-reduce in buckets: many small gradients flattened into a few large reductions.

use tch::Tensor;

use super::Collective;
use crate::error::Result;

/// Default bucket size in elements (25 Mi elements, 50 MiB in bf16).
pub const DEFAULT_BUCKET_ELEMENTS: i64 = 25 << 20;

/// Sums every tensor in `grads` across ranks, in buckets of at most `bucket_elements`
/// (a larger tensor goes alone). Tensors in one bucket must share kind and device, so a bucket
/// also closes when either changes. A no-op on a group of one.
pub fn all_reduce_gradients(collective: &dyn Collective, grads: &mut [Tensor], bucket_elements: i64) -> Result<()> {
    if collective.world_size() == 1 {
        return Ok(());
    }
    let mut start = 0;
    while start < grads.len() {
        let mut end = start + 1;
        let mut elements = grads[start].numel() as i64;
        while end < grads.len()
            && elements + grads[end].numel() as i64 <= bucket_elements
            && grads[end].kind() == grads[start].kind()
            && grads[end].device() == grads[start].device()
        {
            elements += grads[end].numel() as i64;
            end += 1;
        }
        reduce_bucket(collective, &mut grads[start..end])?;
        start = end;
    }
    Ok(())
}

fn reduce_bucket(collective: &dyn Collective, bucket: &mut [Tensor]) -> Result<()> {
    if let [single] = bucket {
        if single.is_contiguous() {
            return collective.all_reduce_sum(single);
        }
    }
    let flat: Vec<Tensor> = bucket.iter().map(|g| g.reshape([-1])).collect();
    let mut joined = Tensor::cat(&flat, 0);
    collective.all_reduce_sum(&mut joined)?;
    let mut offset = 0;
    for g in bucket.iter_mut() {
        let n = g.numel() as i64;
        let part = joined.narrow(0, offset, n).view(g.size().as_slice());
        g.copy_(&part);
        offset += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::local_group;

    #[test]
    fn bucketed_reduction_equals_reducing_each_tensor() {
        let handles: Vec<_> = local_group(2)
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let scale = (c.rank() + 1) as f64;
                    let mut grads: Vec<Tensor> = [[2, 3], [4, 1], [5, 5]]
                        .iter()
                        .enumerate()
                        .map(|(i, s)| Tensor::ones(*s, (tch::Kind::Float, tch::Device::Cpu)) * scale * (i + 1) as f64)
                        .collect();
                    all_reduce_gradients(&c, &mut grads, 10).unwrap();
                    grads.iter().map(|g| g.mean(tch::Kind::Float).double_value(&[])).collect::<Vec<_>>()
                })
            })
            .collect();
        for h in handles {
            // Ranks contribute 1× and 2× of (1, 2, 3): sums are 3, 6, 9.
            assert_eq!(h.join().unwrap(), vec![3.0, 6.0, 9.0]);
        }
    }
}
