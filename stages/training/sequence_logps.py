"""Each sequence's summed log-prob of its labelled tokens, without the batch's full logits.

dpo and kto compare sequences by sum_t log p(token_t | tokens before it) over the labelled
tokens. The plain way (recipes/preference.sequence_logps) takes the logits of every position:
for SmolLM2 (49,152 ids), 32 sequences x 64 tokens are 400 MB of float32 logits, as much again for
the log-softmax and for its gradient, in each of the policy's and the reference's passes. Here:

* only labelled positions reach the output head: the model's forward runs (through every wrapper:
  DDP's hooks, autocast, PEFT) with the head handing back its input (chunked_loss.head_hands_back),
  and the head is applied to chunks of the labelled positions, each chunk under checkpoint when
  gradients are wanted, so the backward recomputes one chunk's logits at a time;
* a batch may be padding-free (stages/training/preference_collators.py): sequences laid end to end
  with restarting position ids and ``sequence_ids`` naming each token's sequence, so no pad is
  computed; the sums are gathered per sequence.

The values equal the plain path's to float rounding, and so do the gradients
(tests/stages/test_sequence_logps.py). ``chunk_tokens`` None (chunked_loss off or not possible for
this model: chunked_loss.chunk_tokens_of) takes the model's full logits but still log-softmaxes
only the labelled rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from registries.tokenize import IGNORE_INDEX

from stages.training.chunked_loss import head_hands_back
from stages.training.heap_release import releases_heap
from stages.training.shared_prefix import SHARED_PREFIX_SDPA, BorrowedPrefixes, outside_passes

FORWARD_COLUMNS = ("input_ids", "attention_mask", "position_ids")
# A vision-language model's images (stages/training/vision_collators.py), where the batch has them.
IMAGE_COLUMNS = ("pixel_values", "image_grid_thw", "mm_token_type_ids", "token_type_ids")
# chunked_loss_tokens null: chunks of ~64 MiB of fp32 logits (341 tokens of a 49k vocabulary), a
# quarter of sft's. A preference step holds a chunk's logits, their log-softmax and, in the
# backward, their gradient: on SmolLM2 LoRA dpo (benchmarks/README.md) the worker's peak fell by
# ~200 MiB against sft's size, at no cost in speed.
AUTO_CHUNK_VALUES = 2**24


def sequence_logps(model, inputs: dict, prefix: str = "", chunk_tokens: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(S,) float32 summed log-probs of each sequence's labelled tokens and (S,) their counts.

    ``inputs`` holds ``{prefix}input_ids`` and ``{prefix}labels``, optionally the attention mask
    and position ids, and for padding-free rows ``{prefix}sequence_ids`` (-1 on pads). Padded
    batches have one sequence per row. ``model`` may be wrapped (DDP, DeepSpeed); the head swap
    is made on the module inside."""
    from accelerate.utils import extract_model_from_parallel

    kwargs = {name: inputs[prefix + name] for name in FORWARD_COLUMNS + IMAGE_COLUMNS
              if inputs.get(prefix + name) is not None}
    borrowed = BorrowedPrefixes.of(inputs, prefix)  # dpo pairs whose rejected answers reuse the prompt's keys
    if borrowed is not None:
        kwargs["borrowed_prefixes"] = borrowed
    labels = inputs[prefix + "labels"]
    owners = inputs.get(prefix + "sequence_ids")
    if owners is None:  # padded: row r is sequence r
        owners = torch.arange(labels.shape[0], device=labels.device)[:, None].expand_as(labels)
        count = labels.shape[0]
    else:
        count = int(owners.max()) + 1
    # Position t's logits predict token t + 1 of its row; in padding-free rows every sequence's
    # first label is IGNORE_INDEX, so no position predicts across two sequences.
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].reshape(-1)
    keep = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    targets, owners = targets.index_select(0, keep), owners.reshape(-1).index_select(0, keep)
    if chunk_tokens is None:
        logits = model(**kwargs, use_cache=False).logits
        per_token = _labelled_logps(logits.reshape(-1, logits.shape[-1]).index_select(0, keep), targets)
    else:
        with head_hands_back(extract_model_from_parallel(model)) as (head_forward, head_dtype):
            hidden = model(**kwargs, use_cache=False).logits
        if head_dtype is not None and hidden.dtype != head_dtype and not torch.is_autocast_enabled(hidden.device.type):
            hidden = hidden.to(head_dtype)  # a forward that upcast its "logits" upcast the hidden states
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)
        per_token = _chunked_logps(head_forward, hidden, targets, chunk_tokens)
    if borrowed is not None and borrowed.calls == 0:
        raise RuntimeError(
            f"This batch's rejected answers begin with their prompt's keys from the chosen sequence, but the "
            f"model's attention never read them: it must run {SHARED_PREFIX_SDPA}. Lay the pairs out without "
            "borrowing (preference_collators.PairwiseCollator, share_prompts=False) for this model."
        )
    sums = per_token.new_zeros(count).index_add(0, owners, per_token)
    lengths = torch.bincount(owners, minlength=count).to(torch.float32)
    return sums, lengths


def _chunked_logps(head_forward, hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    pieces = []
    for start in range(0, targets.numel(), chunk_tokens):
        rows, wanted = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if torch.is_grad_enabled():
            pieces.append(checkpoint(_head_logps, head_forward, rows, wanted, use_reentrant=False))
        else:
            pieces.append(_head_logps(head_forward, rows, wanted))
    # hidden[:0] keeps an empty batch in the graph (a worker whose batch has no labels still backpropagates).
    return torch.cat(pieces) if pieces else hidden[:0, 0].float()


def _head_logps(head_forward, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return _labelled_logps(head_forward(hidden), targets)


def _labelled_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[target] per row, in float32 (bf16's log-softmax loses the small
    differences between chosen and rejected that the preference losses are made of)."""
    logits = logits.float()
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


class SequenceLogpsMixin:
    """A Trainer that sums labelled log-probs with ``sequence_logps``, chunked as ``chunked_loss``
    decides for each model it meets (the policy, a separate reference). Put it before ``Trainer``."""

    def __init__(self, *args, chunked_loss: bool | None = None, chunked_loss_tokens: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunked_loss = chunked_loss
        self.chunked_loss_tokens = chunked_loss_tokens
        self._chunking: dict[int, int | None] = {}  # id(unwrapped model) -> tokens per chunk, None: full logits
        self._releases_heap = releases_heap(self.args)

    def sequence_logps(self, model, inputs: dict, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        from accelerate.utils import extract_model_from_parallel

        from stages.training.chunked_loss import chunk_tokens_of
        from stages.training.heap_release import heap_released

        unwrapped = extract_model_from_parallel(model)
        if id(unwrapped) not in self._chunking:
            # The first pass of a model may be inside kto's recording of the prompts' keys: the probe's
            # forward (chunked_loss.supports_chunked_loss) is not that pass and must keep nothing.
            with outside_passes():
                self._chunking[id(unwrapped)] = chunk_tokens_of(unwrapped, self.chunked_loss,
                                                                self.chunked_loss_tokens, AUTO_CHUNK_VALUES)
        # Each pass's freed blocks go back to the system before the next pass extends the heap.
        with heap_released(self._releases_heap):
            return sequence_logps(model, inputs, prefix, self._chunking[id(unwrapped)])
