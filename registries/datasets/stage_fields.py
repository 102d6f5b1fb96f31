"""Does each dataset carry what the training stage consumes? Checked before reading any row.

The stage table says what each stage needs (one of DATASET_NEEDS); this module knows needs, not
stages:

* ``ranking`` (rm, dpo and its pref_loss variants): a prompt plus a chosen and a rejected answer;
* ``kto_tag`` (kto): a true/false label per answer, and no ranking;
* ``plain`` and ``prompt_only`` (pt, sft, ppo, ...): one answer per prompt, so neither ranking
  pairs nor kto labels, which would otherwise be trained on as if they were good answers.
"""

from __future__ import annotations

from .errors import DataConfigError
from .info import DatasetAttr

# What a stage needs each dataset to carry (the stage table names one per stage):
DATASET_NEEDS = {
    "plain": "one answer per prompt (or plain text)",
    "ranking": "preference pairs: a prompt plus a chosen and a rejected answer (\"ranking\": true)",
    "kto_tag": "single answers each labelled good or bad (a kto_tag column)",
    "prompt_only": "prompts (an answer column, if any, is kept as the reference answer)",
}


def check_stage_fields(attrs: list[DatasetAttr], stage: str, need: str) -> None:
    """Raise DataConfigError for the first dataset that does not carry what ``stage`` needs."""
    if need not in DATASET_NEEDS:
        raise ValueError(f"Unknown dataset need {need!r}; expected one of {', '.join(DATASET_NEEDS)}.")
    for attr in attrs:
        where = f"dataset {attr.name!r} (in {attr.info_path})"
        if need == "ranking" and not attr.ranking:
            raise DataConfigError(
                f"Stage {stage!r} trains on preference pairs, but {where} is not a ranking dataset: it lacks "
                "\"ranking\": true and the columns \"chosen\" and \"rejected\". Use a ranking dataset or add them."
            )
        if need == "kto_tag" and not attr.has_kto_tag:
            raise DataConfigError(
                f"Stage {stage!r} needs a true/false label per answer, but {where} has no kto_tag column. "
                "Add \"columns\": {\"kto_tag\": \"<column>\"} pointing at a boolean column."
            )
        if need == "kto_tag" and attr.ranking:
            raise DataConfigError(
                f"Stage {stage!r} takes single labelled answers, but {where} is a ranking dataset "
                "(chosen/rejected pairs). Use a dataset with a kto_tag column."
            )
        if need != "ranking" and attr.ranking:
            raise DataConfigError(
                f"Stage {stage!r} takes one answer per prompt, but {where} is a ranking dataset "
                "(chosen/rejected pairs), which only the preference stages (rm, dpo) use."
            )
        if need != "kto_tag" and attr.has_kto_tag:
            raise DataConfigError(
                f"Stage {stage!r} would train on every answer, but {where} has a kto_tag column marking some "
                "answers as bad; only the kto stage uses it. Use another dataset or remove the kto_tag column."
            )
