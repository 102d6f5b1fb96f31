"""Our models behind lm-evaluation-harness's model interface, so ``rayfactory eval`` scores any
harness task with the model as chat, serve and training load it (hub id, local folder, ``tiny:``,
``demo:``, adapters unmerged, the config's template) on either engine.

The harness asks three things of a model: the log-likelihood of a continuation after a context
(multiple choice), the rolling log-likelihood of a whole text (perplexity), and text generated
until a stop string. ``TemplateLM``, the harness's own base class, turns the first two into token
ids exactly as its ``hf`` model does (trailing spaces of the context move to the continuation, an
empty context gets the prefix token), so a plain-text task scores the same here as under
``lm_eval --model hf``; the engines then score the ids (``Engine.score``) and generate.

With ``apply_chat_template`` the harness hands over conversations; they are rendered by our
template registry (the token ids training and chat use, not the tokenizer's Jinja template), and
the rendered ids are kept, so a rendered context is never decoded and re-tokenized differently.
"""

from __future__ import annotations

import logging

from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from ..engines.types import GenerationRequest, SamplingSpec
from .chat_model import ChatModel

logger = logging.getLogger(__name__)
DEFAULT_MAX_GEN_TOKS = 256  # the harness's own default for generate_until tasks


class HarnessModel(TemplateLM):
    """A ``ChatModel`` (its tokenizer, template and engine) as a harness model."""

    backend = "causal"

    def __init__(self, chat: ChatModel, batch_size: int = 4, chat_prompts: bool = False, rank: int = 0,
                 world_size: int = 1):
        """``chat_prompts``: the harness renders conversations (apply_chat_template), so a reply also
        ends at the template's end-of-turn tokens; plain text ends at end-of-text only, as under hf.
        ``rank`` / ``world_size``: this process's share of the questions, the harness splitting them
        over the members of a torch.distributed group (fabric/evaluation.py makes one of Ray actors)."""
        super().__init__()
        self._rank, self._world_size = rank, world_size
        self.chat = chat
        self.tokenizer = chat.tokenizer
        self.batch_size = batch_size
        eot = (self.eot_token_id,) if self.eot_token_id is not None else ()
        self.stop_token_ids = tuple(dict.fromkeys(chat.stop_token_ids + eot)) if chat_prompts else eot
        self._rendered: dict[str, tuple[int, ...]] = {}  # chat-rendered text -> the template's ids

    # --- what TemplateLM needs ----------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is conditioned on: BOS where the tokenizer has one (the hf model's rule)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        """The longest sequence scored. transformers: the model's positions, as the harness's hf model
        reads them (rolling windows of long texts split alike); vLLM: its window, less the token a
        scoring request must still be able to add."""
        engine = self.chat.engine
        if engine.name == "vllm":
            return engine.max_model_len - 1
        return getattr(engine.model.config, "max_position_embeddings", None) or engine.max_model_len

    @property
    def tokenizer_name(self) -> str:
        """Keys the harness's request cache: the model and the template that rendered the prompts."""
        return f"{self.tokenizer.name_or_path.replace('/', '__')}-{self.chat.template.name}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """Recorded in the results as the prompt format: our template's name (it renders the ids)."""
        return self.chat.template.name if chat_template else None

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None and string in self._rendered:
            return list(self._rendered[string])
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        bos = self.tokenizer.bos_token
        if add_special_tokens is None and bos and string.startswith(bos):
            options["add_special_tokens"] = False  # the text brings its own BOS (the hf model's rule)
        return self.tokenizer.encode(string, **options)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        rendered = self._rendered.get(context)
        if rendered is None:
            return super()._encode_pair(context, continuation)
        # A chat-rendered context keeps its ids; the answer is encoded as training encodes a reply.
        return list(rendered), self.tokenizer.encode(continuation, add_special_tokens=False)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as our template renders it; the text goes back to the harness, the ids stay here.
        Without ``add_generation_prompt`` the last (assistant) turn is continued, not closed."""
        messages = [dict(m) for m in chat_history]
        system = None
        if messages and messages[0]["role"] == "system":
            system = messages.pop(0)["content"]
        prefix = ""
        if add_generation_prompt or not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": ""})
        else:
            prefix = messages[-1]["content"]
            messages[-1] = {"role": "assistant", "content": ""}
        ids = self.chat.template.encode_oneturn(self.tokenizer, messages, system, None)[0]
        if prefix:
            ids = ids + self.tokenizer.encode(prefix, add_special_tokens=False)
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        self._rendered[text] = tuple(ids)
        return text

    # --- several processes: what the harness gathers with (torch.distributed, gloo) -------------

    def all_gather(self, tensor):
        import torch
        import torch.distributed as dist

        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts)

    def gather_object(self, obj, dst: int = 0):
        import torch.distributed as dist

        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    # --- scoring ----------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probs, whether greedy decoding gives it) per request,
        the context cut from the left to the engine's window as the hf model cuts it."""
        sequences = [(tuple(context) + tuple(continuation))[-(self.max_length + 1):] for _, context, continuation in requests]
        scores = self.chat.score(list(dict.fromkeys(sequences)), self.batch_size)
        results = []
        for (key, _, continuation), sequence in zip(requests, sequences):
            tokens = scores[sequence][-len(continuation):]
            answer = (sum(logprob for logprob, _ in tokens), all(greedy for _, greedy in tokens))
            results.append(answer)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over disjoint windows of the engine's length (the harness's rule)."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            token_windows = get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                                      max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(make_disjoint_window, token_windows):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # --- generation -------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's reply, cut at the first of its stop strings (and the end-of-text token)."""
        eos_text = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        built = []
        for context, gen_kwargs in (request.args for request in requests):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS)
            until = tuple(handle_stop_sequences(kwargs.pop("until", None), eos=eos_text))
            budget = int(kwargs.pop("max_gen_toks"))
            window = min(self.max_length, self.chat.engine.max_model_len)  # what the engine generates in
            prompt = self.tok_encode(context)[-(window - budget):]
            built.append(GenerationRequest(tuple(prompt), self._sampling(kwargs, budget, until)))
        replies = self.chat.complete_all(built)
        results = []
        for (context, gen_kwargs), request, reply in zip((r.args for r in requests), built, replies):
            text = postprocess_generated_text(generation=reply, stop=list(request.sampling.stop_strings),
                                              think_end_token=None)
            results.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return results

    def _sampling(self, kwargs: dict, budget: int, until: tuple[str, ...]) -> SamplingSpec:
        """The task's generation settings; anything the engines cannot honour is named, not ignored."""
        do_sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        top_p = float(kwargs.pop("top_p", 1.0) or 1.0)
        top_k = int(kwargs.pop("top_k", 0) or 0)
        kwargs.pop("max_length", None)  # the budget above is max_gen_toks, as the hf model counts it
        if kwargs:
            logger.warning("generation settings %s of a task are not used by RayFactory's engines", sorted(kwargs))
        greedy = not do_sample or temperature <= 0
        return SamplingSpec(temperature=0.0 if greedy else temperature, top_p=top_p, top_k=top_k, max_tokens=budget,
                            stop_token_ids=self.stop_token_ids, stop_strings=until, logprobs=None)
