"""One recipe per stage, named by its entry in the stage table (stages/table.py): causal_lm (pt, sft),
rm, dpo and kto (with what the preference stages share, preference.py) run in Ray Train workers;
grpo and ppo are controller loops that run in the driver and drive their roles through ``RLRoles``."""
