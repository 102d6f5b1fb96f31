"""vLLM's finished samples as our Completions: the chosen tokens' log-probs and the top ones per
step, n copies of a greedy sample, and (partial rollouts) each token's weights version. Shared by
both ways an engine generates a batch (``VLLMEngine.generate_batch`` and ``generate_stepwise``)
and by the streamed requests."""

from __future__ import annotations

from typing import Optional

from .types import Completion, SamplingSpec


def batch_completions(samples_by_prompt: list, sampling: SamplingSpec, copies: int,
                      versions: Optional[dict] = None) -> list[Completion]:
    """Completions from each prompt's finished vLLM samples (``.index``, ``.token_ids``,
    ``.finish_reason``, ``.logprobs``), in prompt order; ``versions``: (prompt, sample index) ->
    each token's weights version (partial rollouts, stages/engines/inflight_weights.py)."""
    completions = []
    for prompt_index, samples in enumerate(samples_by_prompt):
        for sample in sorted(samples, key=lambda s: s.index):
            if sample.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM ended a completion of prompt {prompt_index} with {sample.finish_reason!r}")
            logprobs, top = sample_logprobs(sample, sampling.logprobs)
            stamps = None if versions is None else versions[prompt_index, sample.index]
            for index in range(sample.index, sample.index + copies):
                completions.append(Completion(list(sample.token_ids), sample.finish_reason, logprobs, top,
                                              index, prompt_index, versions=stamps))
    return completions


def sample_logprobs(sample, top: Optional[int]):
    """vLLM's per-step dicts (the chosen token plus the ``top`` most likely, each with its rank) as
    (chosen log-probs, top pairs per step)."""
    if top is None:
        return None, None
    steps = list(zip(sample.logprobs or (), sample.token_ids))
    chosen = [step[token].logprob for step, token in steps]
    if top <= 0:
        return chosen, [()] * len(chosen)
    pairs = []
    for step, _ in steps:
        best = sorted((lp.rank, -lp.logprob, tid) for tid, lp in step.items() if lp.rank is not None and lp.rank <= top)
        pairs.append(tuple((tid, -neg) for _rank, neg, tid in best[:top]))
    return chosen, pairs
