//! Pure reinforcement-learning math on plain data: group filters and advantages.
