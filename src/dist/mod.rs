//! Data-parallel collectives: NCCL through cudarc, and an in-process collective for tests.
