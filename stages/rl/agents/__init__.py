"""What a multi-turn rollout talks to: tools the policy calls, reset/step environments, the
turn-taking loop (``multi_turn``) and the sandboxed Python interpreter behind the python tool.
Imports config and algorithms, never the workers, the controller or a recipe."""
