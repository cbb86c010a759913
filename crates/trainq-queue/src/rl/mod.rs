//! Pure reinforcement-learning math on plain data: group filters and advantages.
//!
//! Nothing here touches the database, the async runtime or libtorch; the worker feeds it the
//! rewards of claimed groups and records what it decides.

pub mod advantages;
pub mod filter;

pub use advantages::{advantages, mean, population_std, ADVANTAGE_STD_EPS};
pub use filter::{filter_groups, FilterParams, FilterReport, GroupRewards, SkipReason, SkippedGroup};
