"""The RL options of a run (``rl_args``), the checks of single RL stages, how a config's
``module:attribute`` specs resolve, and the sample shapes every room passes around (``types``).
Imports only the algorithms room (its registry names the valid choices) and stages/training."""
