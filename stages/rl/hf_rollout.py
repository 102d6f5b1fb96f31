"""The HF rollout backend: transformers ``generate`` inside the policy process.

The fallback where vLLM is not installed or not wanted; it speaks the vLLM engines' language
(``SamplingSpec`` in, ``Completion`` out), so the RL loop does not know which one ran. It needs
no weight sync at all: it samples from the very weights being trained.
"""

from __future__ import annotations

import torch

from .types import Completion, SamplingSpec


@torch.no_grad()
def hf_generate(model, prompt_ids: list[list[int]], sampling: SamplingSpec, pad_token_id: int,
                batch_size: int = 64) -> list[Completion]:
    """``sampling.n`` completions per prompt, each cut after its first stop token (kept), with
    the raw model log-probability of every sampled token."""
    was_training = model.training
    model.eval()
    generator_seed = sampling.seed
    completions: list[Completion] = []
    expanded = [(i, ids) for i, ids in enumerate(prompt_ids) for _ in range(sampling.n)]
    stop = set(sampling.stop_token_ids)
    for start in range(0, len(expanded), batch_size):
        chunk = expanded[start : start + batch_size]
        width = max(len(ids) for _, ids in chunk)
        # Left padding: every prompt ends where generation starts.
        input_ids = torch.tensor([[pad_token_id] * (width - len(ids)) + ids for _, ids in chunk])
        attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in chunk])
        if generator_seed is not None:
            torch.manual_seed(generator_seed + start)
        out = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention.to(model.device),
            max_new_tokens=sampling.max_tokens,
            **_decoding(sampling),
            eos_token_id=list(sampling.stop_token_ids) or None,
            pad_token_id=pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,  # raw logits, before temperature and top-p: the engines report the same
        )
        new_tokens = out.sequences[:, width:]
        # One step at a time: a [batch, steps, vocab] float32 stack would not fit for real vocabularies.
        chosen = torch.stack([
            logits.float().log_softmax(-1).gather(-1, new_tokens[:, k, None]).squeeze(-1)
            for k, logits in enumerate(out.logits)
        ], dim=1)
        for row, (prompt_index, _) in enumerate(chunk):
            tokens = new_tokens[row].tolist()
            end = next((k + 1 for k, t in enumerate(tokens) if t in stop), None)
            finish = "stop" if end is not None else "length"
            end = end or len(tokens)
            completions.append(Completion(prompt_index, tokens[:end], chosen[row, :end].tolist(), finish))
    model.train(was_training)
    return completions


def _decoding(sampling: SamplingSpec) -> dict:
    """Temperature 0 means greedy, as in vLLM; otherwise sample with the given knobs."""
    if sampling.temperature <= 0:
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    return {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else None}
