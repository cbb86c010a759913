//! The follower's local directory: one subdirectory per fetched step (`{step:06}`), a symlink
//! `current` swapped atomically onto the newest, and pruning to the last K.

use std::path::{Path, PathBuf};

use trainq_queue::StepNumber;

use crate::{Error, Result};

/// The name of the symlink that points at the newest fetched step.
pub const CURRENT_LINK: &str = "current";

/// `DIR/{step:06}`: where step `step` is fetched to.
pub fn step_dir(dir: &Path, step: StepNumber) -> PathBuf {
    dir.join(step_name(step))
}

fn step_name(step: StepNumber) -> String {
    format!("{:06}", step.0)
}

fn io_error(what: String) -> impl FnOnce(std::io::Error) -> Error {
    move |err| Error::Follow { what, message: err.to_string() }
}

/// The step `DIR/current` points at, if it exists and points at a step directory.
pub fn current_step(dir: &Path) -> Option<StepNumber> {
    let target = std::fs::read_link(dir.join(CURRENT_LINK)).ok()?;
    let name = target.file_name()?.to_str()?;
    parse_step_name(name).filter(|_| dir.join(name).is_dir())
}

fn parse_step_name(name: &str) -> Option<StepNumber> {
    if name.len() < 6 || !name.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    name.parse().ok().map(StepNumber)
}

/// Points `DIR/current` at `DIR/{step:06}` in one rename: a reader sees the old target or the
/// new one, never a missing link. The link is relative, so the directory can be moved.
pub fn swap_current(dir: &Path, step: StepNumber) -> Result<()> {
    let temporary = dir.join(format!(".{CURRENT_LINK}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&temporary);
    symlink(Path::new(&step_name(step)), &temporary)
        .map_err(io_error(format!("create symlink {}", temporary.display())))?;
    std::fs::rename(&temporary, dir.join(CURRENT_LINK)).map_err(io_error(format!(
        "rename {} over {}/{CURRENT_LINK}",
        temporary.display(),
        dir.display()
    )))
}

#[cfg(unix)]
fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    std::os::unix::fs::symlink(target, link)
}

#[cfg(not(unix))]
fn symlink(_target: &Path, _link: &Path) -> std::io::Result<()> {
    Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "trainq follow needs symlinks (unix)"))
}

/// The fetched steps under `dir`, ascending.
pub fn fetched_steps(dir: &Path) -> Result<Vec<StepNumber>> {
    let entries = std::fs::read_dir(dir).map_err(io_error(format!("list {}", dir.display())))?;
    let mut steps: Vec<StepNumber> = entries
        .filter_map(|entry| entry.ok())
        .filter(|entry| entry.file_type().map(|t| t.is_dir()).unwrap_or(false))
        .filter_map(|entry| entry.file_name().to_str().and_then(parse_step_name))
        .collect();
    steps.sort();
    Ok(steps)
}

/// The steps to delete so that the newest `keep` (at least 1) stay; `current` always stays.
pub fn steps_to_prune(fetched: &[StepNumber], keep: usize, current: Option<StepNumber>) -> Vec<StepNumber> {
    let keep = keep.max(1);
    let cut = fetched.len().saturating_sub(keep);
    fetched[..cut].iter().copied().filter(|s| Some(*s) != current).collect()
}

/// Deletes all but the newest `keep` step directories (never the one `current` points at) and
/// returns the steps deleted.
pub fn prune(dir: &Path, keep: usize) -> Result<Vec<StepNumber>> {
    let doomed = steps_to_prune(&fetched_steps(dir)?, keep, current_step(dir));
    for step in &doomed {
        let path = step_dir(dir, *step);
        std::fs::remove_dir_all(&path).map_err(io_error(format!("remove {}", path.display())))?;
    }
    Ok(doomed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn steps(v: &[i64]) -> Vec<StepNumber> {
        v.iter().copied().map(StepNumber).collect()
    }

    #[test]
    fn pruning_keeps_the_newest_k_and_never_the_current_step() {
        assert_eq!(steps_to_prune(&steps(&[1, 2, 3, 4, 5]), 3, Some(StepNumber(5))), steps(&[1, 2]));
        assert_eq!(steps_to_prune(&steps(&[1, 2, 3]), 1, Some(StepNumber(2))), steps(&[1]));
        assert_eq!(steps_to_prune(&steps(&[1, 2]), 0, None), steps(&[1]));
        assert!(steps_to_prune(&steps(&[7]), 3, None).is_empty());
    }

    #[test]
    fn the_current_link_is_swapped_in_place_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(current_step(dir.path()), None);
        for step in [1, 2] {
            std::fs::create_dir(step_dir(dir.path(), StepNumber(step))).unwrap();
            swap_current(dir.path(), StepNumber(step)).unwrap();
            assert_eq!(current_step(dir.path()), Some(StepNumber(step)));
        }
        assert_eq!(std::fs::read_link(dir.path().join(CURRENT_LINK)).unwrap(), Path::new("000002"));
        std::fs::create_dir(dir.path().join("notes")).unwrap();
        assert_eq!(fetched_steps(dir.path()).unwrap(), steps(&[1, 2]));
        assert_eq!(prune(dir.path(), 1).unwrap(), steps(&[1]));
        assert_eq!(fetched_steps(dir.path()).unwrap(), steps(&[2]));
    }
}
