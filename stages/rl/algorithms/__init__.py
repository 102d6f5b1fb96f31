"""RL math, pure torch (no Ray, no model): the registry of advantage estimators, policy losses and
KL estimators by name and their built-ins, PPO's per-token rewards, GAE and value loss, REINFORCE++,
SAPO, DAPO's overlong penalty, rollout correction, and the masks of rollout samples. The bottom
room of stages/rl: imports no other room (stages/training at most)."""
