"""Training stages (pt, sft, rm, dpo, kto, ppo): per-worker trainers, losses and their arguments."""
