"""The RL roles fabric/ runs as Ray actors: the policy, PPO's critic and reward model, and what
the learning ones share (the optimizer of a rank, DeepSpeed ZeRO, log-probs, the weights shipped
to the rollout engines, their part of a checkpoint). Imports config and algorithms, never the
agents, the controller or a recipe."""
