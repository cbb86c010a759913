//! One synchronized optimizer step over all ranks.
