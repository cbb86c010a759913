//! A metric over steps, and its downsampling into at most N buckets of (min, mean, max), so a
//! run of 100,000 steps draws as fast and reads as clearly as one of 10.

/// The most points a chart draws per series by default.
pub const DEFAULT_MAX_POINTS: usize = 1000;

/// One named metric: (step, value) pairs in step order; missing or non-finite values are left out.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Legend label, e.g. "reward mean".
    pub name: String,
    /// (step, value), ascending steps.
    pub points: Vec<(i64, f64)>,
}

impl Series {
    /// A series from `(step, value)`s, dropping `None` and non-finite values.
    pub fn new(name: &str, points: impl IntoIterator<Item = (i64, Option<f64>)>) -> Series {
        let points = points.into_iter().filter_map(|(s, v)| v.filter(|v| v.is_finite()).map(|v| (s, v))).collect();
        Series { name: name.to_string(), points }
    }
}

/// One bucket of a downsampled series: the steps it covers (its x is their middle) and the
/// smallest, mean and largest value in it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    /// Middle of the steps the bucket covers.
    pub step: f64,
    /// Smallest value.
    pub min: f64,
    /// Mean value.
    pub mean: f64,
    /// Largest value.
    pub max: f64,
}

/// Buckets `points` into at most `max_buckets` runs of equal step width over
/// `[first_step, last_step]`; with no more points than that, every point is its own bucket.
/// Empty buckets (gaps in the steps) are left out.
pub fn downsample(points: &[(i64, f64)], first_step: i64, last_step: i64, max_buckets: usize) -> Vec<Bucket> {
    let max_buckets = max_buckets.max(1);
    if points.len() <= max_buckets {
        return points.iter().map(|&(s, v)| Bucket { step: s as f64, min: v, mean: v, max: v }).collect();
    }
    let span = (last_step - first_step + 1).max(1) as f64;
    let width = span / max_buckets as f64;
    let mut buckets: Vec<Bucket> = Vec::with_capacity(max_buckets);
    let (mut index, mut sum, mut count) = (usize::MAX, 0.0, 0usize);
    let mut flush = |index: usize, sum: f64, count: usize, current: &mut Option<Bucket>| {
        if let Some(mut b) = current.take() {
            b.mean = sum / count as f64;
            b.step = first_step as f64 + (index as f64 + 0.5) * width - 0.5;
            buckets.push(b);
        }
    };
    let mut current: Option<Bucket> = None;
    for &(s, v) in points {
        let i = (((s - first_step) as f64 / width) as usize).min(max_buckets - 1);
        if i != index {
            flush(index, sum, count, &mut current);
            (index, sum, count) = (i, 0.0, 0);
        }
        let b = current.get_or_insert(Bucket { step: 0.0, min: v, mean: v, max: v });
        b.min = b.min.min(v);
        b.max = b.max.max(v);
        sum += v;
        count += 1;
    }
    flush(index, sum, count, &mut current);
    buckets
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_series_keep_every_point() {
        let points = [(1, 0.5), (2, 0.25), (3, 1.0)];
        let buckets = downsample(&points, 1, 3, 1000);
        assert_eq!(buckets.len(), 3);
        assert_eq!(buckets[1], Bucket { step: 2.0, min: 0.25, mean: 0.25, max: 0.25 });
    }

    #[test]
    fn long_series_become_at_most_n_buckets_with_min_mean_max() {
        let points: Vec<(i64, f64)> = (1..=100_000).map(|s| (s, (s % 10) as f64)).collect();
        let buckets = downsample(&points, 1, 100_000, 1000);
        assert_eq!(buckets.len(), 1000);
        for b in &buckets {
            assert_eq!((b.min, b.max), (0.0, 9.0));
            assert!((b.mean - 4.5).abs() < 1e-9, "{b:?}");
        }
        assert!(buckets[0].step > 1.0 && buckets[999].step < 100_000.0);
        assert!(buckets.windows(2).all(|w| w[0].step < w[1].step));
    }

    #[test]
    fn missing_and_non_finite_values_are_left_out() {
        let series = Series::new("x", [(1, Some(1.0)), (2, None), (3, Some(f64::NAN)), (4, Some(2.0))]);
        assert_eq!(series.points, vec![(1, 1.0), (4, 2.0)]);
    }
}
