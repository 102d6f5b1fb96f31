"""The RL controller: what runs in the driver around the recipe's step (stages/recipes/grpo.py,
ppo.py): where the run stands (``loop``), how a step gets its samples (``rollouts``, multi-turn
``episodes``), rewards (``rewards``, ``remote_reward``), the step log and trackers, and ``roles``,
the interface fabric/ implements. It may import every room below it: agents, workers, config,
algorithms."""
