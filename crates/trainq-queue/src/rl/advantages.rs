//! Group-relative advantages: `A_i = r_i − mean_g`, optionally divided by `std_g + 1e-6`.

/// Added to the group's std before dividing, so a near-constant group cannot blow up.
pub const ADVANTAGE_STD_EPS: f64 = 1e-6;

/// Arithmetic mean; 0 for an empty slice.
pub fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.iter().sum::<f64>() / values.len() as f64
}

/// Population standard deviation (divides by n, not n − 1); 0 for zero or one value.
pub fn population_std(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let m = mean(values);
    let var = values.iter().map(|r| (r - m) * (r - m)).sum::<f64>() / values.len() as f64;
    var.sqrt()
}

/// Advantages of one group's rewards: `r_i − mean`, divided by `std + 1e-6` when `scale_rewards`
/// (population std of the same group).
pub fn advantages(rewards: &[f64], scale_rewards: bool) -> Vec<f64> {
    let m = mean(rewards);
    let scale = if scale_rewards { population_std(rewards) + ADVANTAGE_STD_EPS } else { 1.0 };
    rewards.iter().map(|r| (r - m) / scale).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-9, "{a:?} != {b:?}");
        }
    }

    #[test]
    fn unscaled_advantages_subtract_the_group_mean() {
        // mean of [1, 0, 0, 1] = 0.5
        close(&advantages(&[1.0, 0.0, 0.0, 1.0], false), &[0.5, -0.5, -0.5, 0.5]);
        // mean of [3, 1, 2] = 2
        close(&advantages(&[3.0, 1.0, 2.0], false), &[1.0, -1.0, 0.0]);
    }

    #[test]
    fn scaled_advantages_divide_by_population_std_plus_eps() {
        // [1, 0, 0, 1]: mean 0.5, population std 0.5 -> ±0.5 / 0.500001
        let d = 0.5 + 1e-6;
        close(&advantages(&[1.0, 0.0, 0.0, 1.0], true), &[0.5 / d, -0.5 / d, -0.5 / d, 0.5 / d]);
        // [3, 1, 2]: mean 2, variance (1 + 1 + 0) / 3 = 2/3, std 0.816496580927726
        let d = 0.816_496_580_927_726 + 1e-6;
        close(&advantages(&[3.0, 1.0, 2.0], true), &[1.0 / d, -1.0 / d, 0.0]);
    }

    #[test]
    fn equal_rewards_give_zero_advantages_even_when_scaled() {
        close(&advantages(&[0.7, 0.7, 0.7], true), &[0.0, 0.0, 0.0]);
        close(&advantages(&[5.0], true), &[0.0]);
    }

    #[test]
    fn population_std_divides_by_n() {
        // [2, 4, 4, 4, 5, 5, 7, 9]: the textbook example, mean 5, population std exactly 2
        assert!((population_std(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]) - 2.0).abs() < 1e-12);
        assert_eq!(population_std(&[3.0]), 0.0);
        assert_eq!(population_std(&[]), 0.0);
        assert_eq!(mean(&[]), 0.0);
    }
}
