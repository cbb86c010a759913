//! NCCL through cudarc's bindings, loaded at run time (CPU builds never touch it). One of the
//! few modules allowed `unsafe`: raw device pointers of tch tensors handed to NCCL.
#![allow(unsafe_code)]

use cudarc::nccl::{result, sys};
use tch::{Device, Kind, Tensor};

use super::Collective;
use crate::error::{Error, Result};

/// The 128-byte id that every rank of one NCCL group must share (rank 0 makes it, the others
/// receive it — the rank threads of one host pass it along in memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclUniqueId(pub [u8; 128]);

impl NcclUniqueId {
    /// A fresh id from NCCL (rank 0 calls this).
    pub fn new() -> Result<Self> {
        let id = result::get_uniqueid().map_err(|e| Error::Collective(format!("ncclGetUniqueId: {e:?}")))?;
        Ok(Self(id.internal.map(|c| c as u8)))
    }
}

/// Whether libnccl can be loaded in this process (false on CPU-only machines).
pub fn nccl_available() -> bool {
    std::panic::catch_unwind(result::get_nccl_version).is_ok_and(|v| v.is_ok())
}

/// One rank of an NCCL communicator bound to one CUDA device. Reductions run on the CUDA
/// default stream, the one libtorch computes on, so they are ordered after the backward pass.
pub struct NcclCollective {
    comm: sys::ncclComm_t,
    rank: usize,
    world_size: usize,
    device: Device,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; `&mut self`
// is not required by NCCL but each rank is driven by exactly one thread in trainq.
unsafe impl Send for NcclCollective {}

impl NcclCollective {
    /// Joins the group `id` as `rank` of `world_size`, on CUDA device `ordinal`.
    pub fn new(id: NcclUniqueId, rank: usize, world_size: usize, ordinal: usize) -> Result<Self> {
        let ctx = cudarc::driver::CudaContext::new(ordinal)
            .map_err(|e| Error::Collective(format!("cuda device {ordinal}: {e:?}")))?;
        ctx.bind_to_thread().map_err(|e| Error::Collective(format!("bind cuda device {ordinal}: {e:?}")))?;
        let id = sys::ncclUniqueId { internal: id.0.map(|b| b as _) };
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; NCCL blocks until all ranks have joined.
        unsafe { result::comm_init_rank(&mut comm, world_size as i32, id, rank as i32) }
            .map_err(|e| Error::Collective(format!("ncclCommInitRank rank {rank}/{world_size}: {e:?}")))?;
        Ok(Self { comm, rank, world_size, device: Device::Cuda(ordinal) })
    }
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        // SAFETY: the communicator was created by comm_init_rank and is destroyed once.
        let _ = unsafe { result::comm_destroy(self.comm) };
    }
}

fn nccl_kind(kind: Kind) -> Result<sys::ncclDataType_t> {
    Ok(match kind {
        Kind::Float => sys::ncclDataType_t::ncclFloat32,
        Kind::BFloat16 => sys::ncclDataType_t::ncclBfloat16,
        Kind::Half => sys::ncclDataType_t::ncclFloat16,
        Kind::Double => sys::ncclDataType_t::ncclFloat64,
        Kind::Int64 => sys::ncclDataType_t::ncclInt64,
        other => return Err(Error::Collective(format!("no NCCL type for {other:?}"))),
    })
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_sum(&self, tensor: &mut Tensor) -> Result<()> {
        let on_cpu = tensor.device() == Device::Cpu;
        let mut work = if on_cpu { tensor.to_device(self.device) } else { tensor.contiguous() };
        let datatype = nccl_kind(work.kind())?;
        let ptr = work.data_ptr();
        // SAFETY: `work` is a contiguous CUDA tensor of numel elements of `datatype` that lives
        // until after the call; in-place reduction (send == recv) is allowed by NCCL.
        unsafe {
            result::all_reduce(
                ptr,
                ptr,
                work.numel(),
                datatype,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                std::ptr::null_mut(),
            )
        }
        .map_err(|e| Error::Collective(format!("ncclAllReduce rank {}: {e:?}", self.rank)))?;
        if on_cpu || work.data_ptr() != tensor.data_ptr() {
            work = work.to_device(tensor.device());
            tensor.copy_(&work);
        }
        Ok(())
    }
}
