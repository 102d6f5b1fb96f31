"""Pieces every RL stage (grpo, ppo) shares: the typed RL options, what a rollout sample carries,
advantage/KL/loss math, reward functions, the policy, critic and reward-model workers, the loop's
steps and checkpoints. Placement-free: fabric/ decides where each role runs and hands the recipe
its roles; the rollouts themselves go through stages/engines."""
