"""Pieces every RL stage (grpo, ppo) shares, in rooms by role (docs/architecture.md, "stages/rl"):

* ``controller/``: the driver's side of a run: the loop's bookkeeping, rollouts and episodes,
  rewards (functions, remote servers, judges), the step log and trackers, the ``RLRoles`` protocol.
* ``agents/``: what a multi-turn rollout talks to: tools, environments, the turn-taking loop and
  the Python sandbox.
* ``workers/``: the roles fabric/ runs as Ray actors: policy, critic, reward model, what the
  learning ones share (optimizer, ZeRO, log-probs, weights to ship, checkpoint parts).
* ``config/``: the typed RL options, their per-stage checks, spec resolution, and the sample
  shapes every room passes around.
* ``algorithms/``: pure torch math and the registry of algorithms by name: advantages, KL,
  policy losses, PPO's GAE and value loss, rollout correction.

A room imports only the rooms below it in that list (workers and agents not each other);
tests/test_layering.py holds the rule. Placement-free: fabric/ decides where each role runs and
hands the recipe its roles; the rollouts themselves go through stages/engines."""
