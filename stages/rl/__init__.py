"""Pieces every RL stage shares (grpo now, ppo next): the typed RL options, rollout types,
advantage/KL/loss math, reward functions, the policy worker. Placement-free: fabric/ decides
where each role runs and hands the recipe its roles."""
