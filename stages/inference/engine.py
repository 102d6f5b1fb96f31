"""The one interface every generation engine implements (transformers, vLLM).

Engines speak token ids only: the prompt is built by our template and the reply decoded by our
tokenizer in ``ChatModel``, so whatever the engine, the model sees exactly the token sequence it
was trained on. An engine stops on ``stop_token_ids`` (the template's stop words and eos) and at
``max_new_tokens``; stop *strings* are ChatModel's business (engines may stop early on them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Literal, Optional, Protocol

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class DecodingParams:
    """How to pick tokens. ``do_sample=False`` is greedy (temperature/top_p/top_k ignored)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    repetition_penalty: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()  # a hint: engines that can, stop early; ChatModel truncates
    seed: Optional[int] = None


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    params: DecodingParams
    n: int = 1  # independent replies to the prompt
    adapter: Optional[str] = None  # a name from Engine.adapters; None: the default model
    logprobs: Optional[int] = None  # None: no log-probs; k >= 0: the chosen token's + the top k


@dataclass(frozen=True)
class TokenLogprob:
    """log p of a generated token under the unmodified model (log_softmax of the raw logits),
    and the ``top`` most likely tokens at that step (token id -> log p), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Generated:
    token_ids: list[int]  # the stop token, when one ended the reply, included
    finish_reason: FinishReason
    logprobs: Optional[list[TokenLogprob]] = None
    index: int = 0  # which of the request's n replies


@dataclass
class StreamDelta:
    """New tokens of one reply since the last delta; ``finish_reason`` set on the last."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[TokenLogprob]] = None
    finish_reason: Optional[FinishReason] = None
    index: int = 0


class Engine(Protocol):
    """What ChatModel needs from a backend. Both methods are safe to call concurrently."""

    name: str  # "huggingface" or "vllm"
    max_model_len: int  # prompt + reply tokens the engine accepts
    adapters: tuple[str, ...]  # adapter names a request may select

    async def generate(self, request: GenerationRequest) -> list[Generated]:
        """``request.n`` finished replies, by index."""
        ...

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        """Deltas of reply 0 .. n-1 (``index`` says which) until each has a finish_reason."""
        ...

    async def close(self) -> None: ...


async def collect(deltas: AsyncIterator[StreamDelta], request: GenerationRequest) -> list[Generated]:
    """An engine's ``generate``: its stream, gathered into whole replies."""
    replies = [Generated([], "length", [] if request.logprobs is not None else None, i) for i in range(request.n)]
    async for delta in deltas:
        reply = replies[delta.index]
        reply.token_ids += delta.token_ids
        if delta.logprobs is not None:
            reply.logprobs += delta.logprobs
        if delta.finish_reason:
            reply.finish_reason = delta.finish_reason
    return replies


class PromptTooLong(ValueError):
    """The prompt leaves no room for a reply in the engine's context window."""

    def __init__(self, prompt_tokens: int, max_model_len: int):
        self.prompt_tokens, self.max_model_len = prompt_tokens, max_model_len
        super().__init__(
            f"the prompt is {prompt_tokens} tokens, but the model's context window is {max_model_len} tokens "
            "(prompt and reply together). Shorten the conversation, or raise vllm_maxlen / cutoff_len."
        )


def check_prompt_fits(request: GenerationRequest, max_model_len: int) -> int:
    """The reply budget: ``max_new_tokens`` cut to what the context window leaves; raises
    ``PromptTooLong`` when nothing is left."""
    room = max_model_len - len(request.prompt_ids)
    if room < 1:
        raise PromptTooLong(len(request.prompt_ids), max_model_len)
    return min(request.params.max_new_tokens, room)
