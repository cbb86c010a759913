//! An in-process collective over threads, one member per rank: the same arithmetic as NCCL's
//! sum all-reduce, summed in rank order, for tests of data-parallel training on the CPU.

use std::sync::{Arc, Barrier, Mutex};

use tch::Tensor;

use super::Collective;
use crate::error::{Error, Result};

struct Shared {
    barrier: Barrier,
    slots: Mutex<Vec<Option<Tensor>>>,
}

/// One member of an in-process group; move each to its own thread.
pub struct LocalCollective {
    rank: usize,
    world_size: usize,
    shared: Arc<Shared>,
}

/// Creates the `world_size` members of one in-process group.
pub fn local_group(world_size: usize) -> Vec<LocalCollective> {
    let shared = Arc::new(Shared {
        barrier: Barrier::new(world_size),
        slots: Mutex::new((0..world_size).map(|_| None).collect()),
    });
    (0..world_size).map(|rank| LocalCollective { rank, world_size, shared: Arc::clone(&shared) }).collect()
}

impl Collective for LocalCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_sum(&self, tensor: &mut Tensor) -> Result<()> {
        let poisoned = |_| Error::Collective("a rank panicked during all-reduce".into());
        self.shared.slots.lock().map_err(poisoned)?[self.rank] = Some(tensor.copy());
        self.shared.barrier.wait(); // every rank has written its slot
        let sum = {
            let slots = self.shared.slots.lock().map_err(poisoned)?;
            let mut parts = slots.iter().map(|s| s.as_ref().map(Tensor::shallow_clone));
            let first = parts.next().flatten().ok_or_else(|| Error::Collective("empty slot".into()))?;
            parts.try_fold(first, |acc, t| t.map(|t| acc + t).ok_or_else(|| Error::Collective("empty slot".into())))?
        };
        self.shared.barrier.wait(); // every rank has read every slot
        self.shared.slots.lock().map_err(poisoned)?[self.rank] = None;
        tensor.copy_(&sum);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_reduce_sums_over_every_rank() {
        let handles: Vec<_> = local_group(3)
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let mut t = Tensor::from_slice(&[c.rank() as f32, 1.0]);
                    c.all_reduce_sum(&mut t).unwrap();
                    let again = c.all_reduce_scalar(2.0).unwrap();
                    (Vec::<f32>::try_from(&t).unwrap(), again)
                })
            })
            .collect();
        for h in handles {
            let (t, again) = h.join().unwrap();
            assert_eq!(t, vec![3.0, 3.0]);
            assert_eq!(again, 6.0);
        }
    }
}
