//! The demo's toy task: the user asks for a short line, the reward is the share of digits in it.
//!
//! A tiny random model answers with near-uniform characters, so about a fifth of them are digits
//! and the rewards inside a group differ; the policy learns to emit digits and the mean reward
//! climbs toward 1.

/// Prompts the toy environment cycles through.
pub const PROMPTS: [&str; 4] = ["write a line", "say something", "give me a code", "type eight characters"];

/// How many completion characters count toward the reward.
pub const SCORED_CHARS: usize = 8;

/// Reward of one completion: digits among its first [`SCORED_CHARS`] characters, over
/// [`SCORED_CHARS`] (a short answer cannot score high by being short).
pub fn reward(completion: &str) -> f64 {
    let digits = completion.chars().take(SCORED_CHARS).filter(char::is_ascii_digit).count();
    digits as f64 / SCORED_CHARS as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reward_counts_digits_among_the_first_eight_characters() {
        assert_eq!(reward("12345678"), 1.0);
        assert_eq!(reward("ab12"), 0.25);
        assert_eq!(reward(""), 0.0);
        assert_eq!(reward("abcdefgh123"), 0.0);
    }
}
