"""Chunked cross-entropy for pt and sft: the causal-LM loss without a micro-batch's full logits.

The model's own loss (transformers' ForCausalLMLoss) takes the logits of every token at once:
tokens x vocabulary in the model's dtype, an fp32 copy, its log-softmax and, in the backward, an
fp32 gradient as large. With a 150k vocabulary and 8k tokens that is ~5 GiB per copy, more than
a 7B LoRA's checkpointed activations. Here the head and the cross-entropy run over chunks of the
labelled tokens (unlabelled ones never reach the head), each chunk under torch.utils.checkpoint:
the forward keeps only each chunk's summed loss, and the backward recomputes one chunk's logits
at a time. The loss is the model's own to float rounding: the same label shift, ignore_index
and ``num_items_in_batch`` division (the Trainer's normalisation across gradient accumulation).

How it is wired: the model's forward still runs through every wrapper around it (DDP's
gradient hooks, accelerate's autocast, PEFT), with two swaps for that one call: the output
head hands back its input (the final hidden states), and the model's ``loss_function`` is the
chunked loss, which calls the real head on each chunk. Calling the decoder directly instead
would skip DDP's forward, and with it the gradient all-reduce: workers would drift apart silently.

Which models: those whose forward returns the head's output unchanged as the logits. One that
changes them after the head (Gemma 2's final_logit_softcapping, Cohere's logit_scale) would make
the swap compute a wrong loss, so a probe of four tokens checks each model once and such models
keep the plain loss; so do ZeRO-3 (its head weight exists only inside the head's own call),
label smoothing, a custom compute_loss_func, and evaluation (which needs the logits).
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
# chunked_loss: null turns it on from this vocabulary size (Llama 3, Qwen, Gemma, SmolLM: 49k to
# 256k); below it the logits are small next to the activations, and the tiny test models keep the
# plain path.
AUTO_MIN_VOCAB = 32768
# chunked_loss_tokens: null sizes a chunk to ~256 MiB of fp32 logits (2**26 values): 1365 tokens of
# a 49k vocabulary, 441 of a 152k one; big enough that each chunk's matmul stays efficient.
AUTO_CHUNK_VALUES = 2**26
MIN_CHUNK_TOKENS = 64


def use_chunked_loss(setting: bool | None, vocab_size: int) -> bool:
    """``chunked_loss`` resolved: true/false as set; null (auto) from AUTO_MIN_VOCAB tokens of vocabulary."""
    return bool(setting) if setting is not None else vocab_size >= AUTO_MIN_VOCAB


def chunk_tokens_for(vocab_size: int, requested: int | None = None, auto_values: int = AUTO_CHUNK_VALUES) -> int:
    """Tokens per chunk: ``chunked_loss_tokens`` if set, else ``auto_values`` fp32 logits (~256 MiB)."""
    if requested:
        return int(requested)
    return max(MIN_CHUNK_TOKENS, auto_values // max(vocab_size, 1))


def chunked_cross_entropy(hidden: torch.Tensor, labels: torch.Tensor | None, head_forward, chunk_tokens: int,
                          num_items_in_batch=None, ignore_index: int = IGNORE_INDEX,
                          shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """ForCausalLMLoss(head(hidden), labels), one chunk of labelled tokens at a time.

    ``hidden``: (batch, seq, hidden) final hidden states; ``head_forward``: the output head's
    forward. Rows are shifted one by one (a token predicts the next in its own row), as the
    model's loss does; padding-free rows mark each example's first label ignored already."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden.device)
    keep = (targets != ignore_index).nonzero().squeeze(1)
    hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)
    targets = targets.index_select(0, keep)
    # Starts as a zero that is part of the graph: a micro-batch without labels still backpropagates.
    total = hidden[:0].sum(dtype=torch.float32)
    for start in range(0, targets.numel(), chunk_tokens):
        end = start + chunk_tokens
        total = total + checkpoint(_chunk_loss, head_forward, hidden[start:end], targets[start:end],
                                   use_reentrant=False)
    if num_items_in_batch is None:  # cross_entropy's "mean": NaN when nothing is labelled, as there
        return total / targets.numel()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _chunk_loss(head_forward, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head_forward(hidden).float()  # upcast as ForCausalLMLoss does
    return F.cross_entropy(logits, targets, reduction="sum")


def language_model(model):
    """The causal LM that owns the head and the loss: a PeftModel's base model, else the model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def output_head(model):
    base = language_model(model)
    return base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None


def vocab_size_of(model) -> int:
    head = output_head(model)
    size = getattr(head, "out_features", None)
    if size is None:
        config = language_model(model).config
        size = getattr(config.get_text_config(), "vocab_size", 0) or 0
    return int(size)


def supports_chunked_loss(model) -> bool:
    """Whether ``model`` (a causal LM or a PeftModel around one) returns its head's output unchanged
    as the logits: a forward of four tokens, compared exactly."""
    if getattr(model, "active_peft_config", None) is not None and model.active_peft_config.is_prompt_learning:
        return False  # prompt tuning prepends virtual tokens outside the base model's forward
    base, head = language_model(model), output_head(model)
    if head is None or not hasattr(base, "loss_function") or getattr(head, "weight", None) is None:
        return False
    seen = []
    hook = head.register_forward_hook(lambda module, args, output: seen.append(output))
    was_training = base.training
    try:
        base.eval()
        ids = torch.arange(1, 5, device=head.weight.device)[None] % max(vocab_size_of(model), 1)
        with torch.no_grad():
            logits = base(input_ids=ids, use_cache=False).logits
    except Exception:  # noqa: BLE001 (a forward that cannot take plain ids keeps the plain loss)
        logger.debug("chunked loss probe failed", exc_info=True)
        return False
    finally:
        hook.remove()
        base.train(was_training)
    return len(seen) == 1 and torch.is_tensor(seen[0]) and torch.equal(seen[0].float(), logits.float())


@contextlib.contextmanager
def chunked_head_loss(model, chunk_tokens: int):
    """For the calls inside: ``model(**batch, labels=...)`` computes its loss chunk by chunk; its
    ``logits`` are then the final hidden states (the head is not applied to the whole batch)."""
    base = language_model(model)
    with head_hands_back(model) as (head_forward, head_dtype):

        def loss_function(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=IGNORE_INDEX,
                          shift_labels=None, **kwargs):
            if (head_dtype is not None and logits.dtype != head_dtype
                    and not torch.is_autocast_enabled(logits.device.type)):
                logits = logits.to(head_dtype)
            return chunked_cross_entropy(logits, labels, head_forward, chunk_tokens, num_items_in_batch,
                                         ignore_index, shift_labels)

        with _instance_attribute(base, "_loss_function", loss_function):
            yield


@contextlib.contextmanager
def head_hands_back(model):
    """For the calls inside, ``model``'s output head returns its input: a forward's ``logits`` are
    the final hidden states. Yields (the head's real forward, the head's weight dtype or None).

    A forward that upcasts its logits (logits.float()) upcasts the hidden states handed back in
    their place; callers give them to the real head in its own dtype, as the plain forward did."""
    head = output_head(model)
    weight = getattr(head, "weight", None)
    head_dtype = weight.dtype if weight is not None and weight.is_floating_point() else None
    head_forward = head.forward
    with _instance_attribute(head, "forward", _hand_back):
        yield head_forward, head_dtype


def _hand_back(hidden):
    return hidden


@contextlib.contextmanager
def _instance_attribute(obj, name: str, value):
    """Set ``obj.name`` for the block, then put back what was there (an instance attribute or none):
    accelerate and PEFT may have set instance forwards of their own."""
    had, old = name in obj.__dict__, obj.__dict__.get(name)
    object.__setattr__(obj, name, value)
    try:
        yield
    finally:
        if had:
            object.__setattr__(obj, name, old)
        else:
            obj.__dict__.pop(name, None)


class ChunkedLossMixin:
    """A Trainer whose training loss is chunked (``chunked_loss``; see the module docstring for
    when it falls back to the plain one). Put it before ``Trainer`` in the bases."""

    def __init__(self, *args, chunked_loss: bool | None = None, chunked_loss_tokens: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunked_loss = chunked_loss
        self.chunked_loss_tokens = chunked_loss_tokens
        self._chunking: dict[int, int | None] = {}  # id(model) -> tokens per chunk, None: plain loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        tokens = None if return_outputs else self._chunk_tokens(model, inputs)
        if tokens is None:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        with chunked_head_loss(self.accelerator.unwrap_model(model), tokens):
            return super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)

    def _chunk_tokens(self, model, inputs) -> int | None:
        if "labels" not in inputs or "logits_to_keep" in inputs:
            return None
        if self.label_smoother is not None or self.compute_loss_func is not None:
            return None  # they read the logits themselves
        unwrapped = self.accelerator.unwrap_model(model)
        if id(unwrapped) not in self._chunking:
            self._chunking[id(unwrapped)] = self._decide(unwrapped)
        return self._chunking[id(unwrapped)]

    def _decide(self, model) -> int | None:
        return chunk_tokens_of(model, self.chunked_loss, self.chunked_loss_tokens)


def chunk_tokens_of(model, setting: bool | None, requested_tokens: int | None = None,
                    auto_values: int = AUTO_CHUNK_VALUES) -> int | None:
    """Tokens per chunk for ``model`` under ``chunked_loss: setting``, or None for the plain path:
    off as set, below AUTO_MIN_VOCAB on null, under ZeRO-3, or where the head's output is not the logits."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    vocab = vocab_size_of(model)
    if not use_chunked_loss(setting, vocab):
        return None
    reason = ("DeepSpeed ZeRO-3 partitions the head's weight" if is_deepspeed_zero3_enabled()
              else None if supports_chunked_loss(model)
              else f"{type(language_model(model)).__name__} changes its logits after the output head")
    if reason is not None:
        log = logger.warning if setting else logger.info
        log("chunked_loss: using the plain loss instead: %s.", reason)
        return None
    tokens = chunk_tokens_for(vocab, requested_tokens, auto_values)
    logger.info("chunked_loss: the head runs in chunks of %d tokens (vocabulary %d)", tokens, vocab)
    return tokens
