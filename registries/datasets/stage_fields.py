"""Does each dataset carry what the training stage consumes? Checked before reading any row.

* preference stages (rm, dpo and its variants) need ranking datasets: a prompt plus a chosen
  and a rejected answer;
* kto needs a kto_tag column (a true/false label per answer), and no ranking;
* every other stage (pt, sft, ppo, grpo, ...) takes one answer per prompt, so neither ranking
  pairs nor kto labels, which would otherwise be trained on as if they were good answers.
"""

from __future__ import annotations

from .errors import DataConfigError
from .info import DatasetAttr

RANKING_STAGES = ("rm", "dpo", "orpo", "simpo")
KTO_STAGES = ("kto",)


def check_stage_fields(attrs: list[DatasetAttr], stage: str) -> None:
    for attr in attrs:
        where = f"dataset {attr.name!r} (in {attr.info_path})"
        if stage in RANKING_STAGES and not attr.ranking:
            raise DataConfigError(
                f"Stage {stage!r} trains on preference pairs, but {where} is not a ranking dataset: it lacks "
                "\"ranking\": true and the columns \"chosen\" and \"rejected\". Use a ranking dataset or add them."
            )
        if stage in KTO_STAGES and not attr.has_kto_tag:
            raise DataConfigError(
                f"Stage {stage!r} needs a true/false label per answer, but {where} has no kto_tag column. "
                "Add \"columns\": {\"kto_tag\": \"<column>\"} pointing at a boolean column."
            )
        if stage in KTO_STAGES and attr.ranking:
            raise DataConfigError(
                f"Stage {stage!r} takes single labelled answers, but {where} is a ranking dataset "
                "(chosen/rejected pairs). Use a dataset with a kto_tag column."
            )
        if stage not in RANKING_STAGES and attr.ranking:
            raise DataConfigError(
                f"Stage {stage!r} takes one answer per prompt, but {where} is a ranking dataset "
                f"(chosen/rejected pairs), which only the stages {', '.join(RANKING_STAGES)} use."
            )
        if stage not in KTO_STAGES and attr.has_kto_tag:
            raise DataConfigError(
                f"Stage {stage!r} would train on every answer, but {where} has a kto_tag column marking some "
                "answers as bad; only the kto stage uses it. Use another dataset or remove the kto_tag column."
            )
