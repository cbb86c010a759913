//! Splitting a step's micro-batches across ranks so each rank gets about the same token count.

/// Assigns micro-batches (given by their token counts) to `world_size` ranks, largest first,
/// each to the rank with the fewest tokens so far; returns the indices per rank, in order.
///
/// Deterministic: every rank computes the same split from the same input.
pub fn split_by_tokens(token_counts: &[usize], world_size: usize) -> Vec<Vec<usize>> {
    let world_size = world_size.max(1);
    let mut order: Vec<usize> = (0..token_counts.len()).collect();
    order.sort_by(|&a, &b| token_counts[b].cmp(&token_counts[a]).then(a.cmp(&b)));
    let mut load = vec![0usize; world_size];
    let mut ranks: Vec<Vec<usize>> = vec![Vec::new(); world_size];
    for i in order {
        let rank = (0..world_size).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        load[rank] += token_counts[i];
        ranks[rank].push(i);
    }
    for r in &mut ranks {
        r.sort_unstable();
    }
    ranks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_micro_batch_goes_to_exactly_one_rank() {
        let counts = [5, 9, 1, 7, 3, 3, 8];
        let split = split_by_tokens(&counts, 3);
        let mut all: Vec<usize> = split.iter().flatten().copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..counts.len()).collect::<Vec<_>>());
    }

    #[test]
    fn token_loads_are_balanced() {
        let counts = [8, 8, 4, 4, 4, 4];
        let split = split_by_tokens(&counts, 2);
        let loads: Vec<usize> = split.iter().map(|r| r.iter().map(|&i| counts[i]).sum()).collect();
        assert_eq!(loads, vec![16, 16]);
    }

    #[test]
    fn more_ranks_than_batches_leaves_some_ranks_empty() {
        let split = split_by_tokens(&[3], 4);
        assert_eq!(split.iter().filter(|r| r.is_empty()).count(), 3);
    }
}
