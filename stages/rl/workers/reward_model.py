"""PPO's reward role: a frozen reward model from stage rm that scores each completion.

``reward_model_type`` keeps LLaMA-Factory's meaning: ``lora``, the reward model is an rm adapter
(with its value head) on the policy's own base model; ``full``, a whole model of its own. Either
way it must share the policy's tokenizer, because it reads the policy's token ids directly.

A sequence is scored the way stage rm trained: the value head at the last token of prompt +
reply. Stage rm's replies end with the template's whole end-of-turn (Qwen: ``<|im_end|>`` and a
newline), the sampler stops at the stop token, so a finished completion gets the rest of the
end-of-turn appended before it is scored; a truncated one is scored as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from registries.errors import UserError

from stages.rl.config.types import RolloutSample

if TYPE_CHECKING:
    from stages.job import JobSpec

BATCH_SIZE = 16  # sequences per forward pass


class RewardModelError(UserError):
    """A reward model that cannot score this policy's completions."""


class RewardModelWorker:
    def __init__(self, spec: "JobSpec"):
        self.spec = spec

    def setup(self) -> dict:
        from stages.loading import load_reward_model, load_tokenizer_and_template, resolve_model_path

        spec, tuning = self.spec, self.spec.finetuning
        tokenizer, template = load_tokenizer_and_template(spec.model, spec.data)
        base = resolve_model_path(spec.model.model_name_or_path) if tuning.reward_model_type == "lora" else None
        self.model, reward_tokenizer = load_reward_model(tuning.reward_model, base_model=base, template=template.name)
        if torch.cuda.is_available():
            self.model.to("cuda")
        if reward_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise RewardModelError(
                f"reward_model {tuning.reward_model} has a different tokenizer ({len(reward_tokenizer)} tokens) from "
                f"the policy {spec.model.model_name_or_path} ({len(tokenizer)} tokens); PPO scores the policy's "
                "token ids directly. Train the reward model (stage rm) from the policy's base model or one of its "
                "family with the same tokenizer."
            )
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.stop_ids = set(template.stop_token_ids(tokenizer))
        self.suffix = turn_suffix(tokenizer, template)
        return {"reward_model": tuning.reward_model, "suffix": self.suffix}

    def scores(self, samples: list[RolloutSample]) -> list[float]:
        """One score per completion, in order."""
        from stages.training.value_head import score

        rows = [s.prompt_ids + s.completion_ids + (self.suffix if self._finished(s) else []) for s in samples]
        out: list[float] = []
        for start in range(0, len(rows), BATCH_SIZE):
            chunk = rows[start : start + BATCH_SIZE]
            width = max(len(r) for r in chunk)
            ids = torch.tensor([r + [self.pad_token_id] * (width - len(r)) for r in chunk])
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in chunk])
            out += score(self.model, ids, mask).tolist()
        return out

    def _finished(self, sample: RolloutSample) -> bool:
        return bool(sample.completion_ids) and sample.completion_ids[-1] in self.stop_ids


def turn_suffix(tokenizer, template) -> list[int]:
    """The tokens the template writes after a reply's stop token (Qwen: the newline after
    ``<|im_end|>``; none for templates whose turn ends at the stop token)."""
    turn = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
    _, response = template.encode_oneturn(tokenizer, turn, "", "")
    if template.efficient_eos:
        response = response + [tokenizer.eos_token_id]
    stops = set(template.stop_token_ids(tokenizer))
    ends = [i for i, token in enumerate(response) if token in stops]
    return response[ends[-1] + 1 :] if ends else []
