//! Policy losses in tch: PPO clip, CISPO, token- or sequence-level (GSPO) ratio, k3 KL.
