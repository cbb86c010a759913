//! Data-parallel collectives: NCCL through cudarc for GPUs, an in-process group for tests, and
//! the pure arithmetic of splitting a step's micro-batches across ranks by token count.
//!
//! Every rank computes its loss divided by the step's *global* normalizer (e.g. the total
//! number of trained tokens over all ranks), so summing the ranks' gradients gives exactly the
//! gradient one rank would compute over the whole batch.

mod buckets;
mod local;
mod nccl;
mod split;

pub use buckets::{all_reduce_gradients, DEFAULT_BUCKET_ELEMENTS};
pub use local::{local_group, LocalCollective};
pub use nccl::{nccl_available, NcclCollective, NcclUniqueId};
pub use split::split_by_tokens;

use tch::Tensor;

use crate::error::Result;

/// A group of ranks that can sum tensors across its members.
pub trait Collective: Send {
    /// This member's rank, from 0.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world_size(&self) -> usize;
    /// Replaces `tensor` on every rank with the sum over ranks (same shape, kind and device).
    fn all_reduce_sum(&self, tensor: &mut Tensor) -> Result<()>;

    /// Sums a scalar over ranks (e.g. the global trained-token count).
    fn all_reduce_scalar(&self, value: f64) -> Result<f64> {
        let mut t = Tensor::from_slice(&[value]);
        self.all_reduce_sum(&mut t)?;
        Ok(t.double_value(&[0]))
    }
}

/// The trivial group of one rank: every reduction is the identity.
#[derive(Debug, Default, Clone, Copy)]
pub struct SingleRank;

impl Collective for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _tensor: &mut Tensor) -> Result<()> {
        Ok(())
    }
}
