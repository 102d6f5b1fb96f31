"""The language every generation engine speaks: token ids in, token ids and log-probs out.

Engines never see text. Prompts are built by our template, replies decoded by our tokenizer
(ChatModel for chat, serve, predict and the web UI; the RL loop for rollouts), so whichever engine
runs, the model sees exactly the token sequence it was trained on. An engine stops a reply at
the first of ``stop_token_ids`` (the template's stop words and eos; the stop token is kept) or at
``max_tokens``; stop *strings* are the decoder's business (engines may stop early on them).

Plain dataclasses of Python numbers: they cross Ray actor boundaries cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Literal, Optional, Protocol

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingSpec:
    """How to pick tokens: ``n`` replies per prompt, at most ``max_tokens`` new tokens each.

    ``temperature`` 0 (or below) is greedy decoding, as in vLLM and OpenAI clients; greedy replies
    are all the same, so an engine generates one and hands it out n times. ``logprobs``: None
    reports no log-probs; k >= 0 reports the chosen token's raw log-prob (log_softmax of the
    unmodified logits, before temperature / top-k / top-p) and the k most likely tokens'.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    repetition_penalty: float = 1.0
    max_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()  # a hint: engines that can, stop early; the decoder cuts
    seed: Optional[int] = None
    logprobs: Optional[int] = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt, for the streaming side (chat, serve): ``adapter`` names one of the engine's
    ``adapters``; None is the engine's default model. Not always plain numbers: ``images`` holds
    tensors, so such a request stays in the process that built it."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingSpec
    adapter: Optional[str] = None
    # A vision model's image inputs for this prompt: the processor's tensors (pixel_values,
    # image_grid_thw, ...) whose image tokens ``prompt_ids`` already holds. Only the transformers
    # engine takes them (stages/inference/vision_inputs.py builds them).
    images: Optional[dict] = None


@dataclass
class Completion:
    """One reply: ``index`` of its prompt's n, ``prompt_index`` the prompt's place in a batch.

    ``logprobs`` hold the raw log-prob of each token (when asked for), ``top_logprobs`` the most
    likely (token id, log-prob) pairs at each step, most likely first (when k > 0 was asked for).
    """

    token_ids: list[int]
    finish_reason: FinishReason = "stop"
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[tuple[tuple[int, float], ...]]] = None
    index: int = 0
    prompt_index: int = 0
    # partial rollouts: per token, the weights version (pushes loaded by the engine) that sampled it
    versions: Optional[list[int]] = None


@dataclass
class StreamDelta:
    """New tokens of reply ``index`` since its last delta; ``finish_reason`` set on its last."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[tuple[tuple[int, float], ...]]] = None
    finish_reason: Optional[FinishReason] = None
    index: int = 0


class Engine(Protocol):
    """What every backend offers (stages/engines/hf_backend.py, vllm_backend.py).

    The streaming side (``generate``, ``stream``) serves concurrent requests; ``generate_batch``
    is the rollout side: many prompts at once, n replies each. The RL hooks are
    ``load_weights`` / ``reset_cache``; a backend that samples from the trained weights
    themselves (HF inside the policy) needs neither. HFEngine offers both sides on one model;
    vLLM has two front ends, so a VLLMEngine is built for one side: for rollouts (offline ``LLM``:
    ``generate_batch`` and the weight hooks) or for requests (``AsyncLLM``: ``stream``/``generate``
    and ``pause``/``resume``), and says so when asked for the other.
    """

    name: str  # "huggingface" or "vllm"
    max_model_len: int  # prompt + reply tokens the engine accepts
    adapters: tuple[str, ...]  # adapter names a request may select

    async def generate(self, request: GenerationRequest) -> list[Completion]:
        """``request.sampling.n`` finished replies, by index."""
        ...

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        """Deltas of reply 0 .. n-1 (``index`` says which) until each has a finish_reason. Closing
        the iterator early aborts the request."""
        ...

    def generate_batch(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[Completion]:
        """``sampling.n`` replies per prompt, grouped by prompt in request order."""
        ...

    async def close(self) -> None: ...


async def collect(deltas: AsyncIterator[StreamDelta], sampling: SamplingSpec) -> list[Completion]:
    """An engine's ``generate``: its stream, gathered into whole replies."""
    wants_logprobs = sampling.logprobs is not None
    replies = [Completion([], "length", [] if wants_logprobs else None, [] if wants_logprobs else None, i)
               for i in range(sampling.n)]
    async for delta in deltas:
        reply = replies[delta.index]
        reply.token_ids += delta.token_ids
        if delta.logprobs is not None and reply.logprobs is not None:
            reply.logprobs += delta.logprobs
            reply.top_logprobs += delta.top_logprobs or [()] * len(delta.logprobs)
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


def check_prompt_fits(prompt_ids, sampling: SamplingSpec, max_model_len: int) -> int:
    """The reply budget: ``max_tokens`` cut to what the context window leaves; raises
    ``PromptTooLong`` when nothing is left."""
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise PromptTooLong(len(prompt_ids), max_model_len)
    return min(sampling.max_tokens, room)


def cut_at_stop(token_ids: list[int], stop_token_ids) -> tuple[int, FinishReason]:
    """Where a generated row ends: after its first stop token ("stop"), else all of it ("length")."""
    stop = set(stop_token_ids)
    end = next((k + 1 for k, t in enumerate(token_ids) if t in stop), None)
    return (end, "stop") if end is not None else (len(token_ids), "length")
