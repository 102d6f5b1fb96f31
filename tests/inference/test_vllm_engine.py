"""ChatModel on vLLM against ChatModel on transformers, same base and adapters, float32 both sides:
the same greedy tokens, the same raw log-probs. One vLLM engine for the module (its start is the
slow part); the bare base is a second view (a copy of the VLLMEngine) on that engine with no default adapter."""

from __future__ import annotations

import copy
import importlib.util

import pytest

from tests.ci import skip_or_fail_in_ci

from .conftest import BASE, PROMPTS, make_adapter_output

# A skip without vLLM on a developer's machine; in CI a failure, as for the other parity tests.
if importlib.util.find_spec("vllm") is None:
    skip_or_fail_in_ci("vllm is not installed (pip install -e .[vllm]): the vLLM parity tests did not run",
                       allow_module_level=True)

MAXLEN = 128
SETTINGS = {"do_sample": False, "max_new_tokens": 16, "vllm_maxlen": MAXLEN}


def _config(adapter_outputs, **extra):
    return {"model_name_or_path": BASE, "template": "qwen", **SETTINGS, **extra}


@pytest.fixture(scope="module")
def chats(adapter_outputs):
    """(vllm ChatModel, hf ChatModel) for base + default adapter "math" + lora_modules {"poet"},
    the bare-base engine view, and the HF bare base."""
    from cluster.api import ChatModel

    config = _config(adapter_outputs, adapter_name_or_path=adapter_outputs["math"],
                     lora_modules={"poet": adapter_outputs["poet"]})
    vllm_chat = ChatModel(dict(config, infer_backend="vllm", vllm_cpu_kv_cache_gib=0.05))
    engine = vllm_chat.engine
    bare = copy.copy(engine)  # the same AsyncLLM, serving the bare base when a request names no adapter
    bare.default_adapter = None
    hf_chat = ChatModel(config)
    hf_base = ChatModel(_config(adapter_outputs))
    yield vllm_chat, hf_chat, bare, hf_base
    bare.llm = None  # a view: the engine is closed once, through its ChatModel
    vllm_chat.close()
    assert engine.llm is None


@pytest.mark.parametrize("adapter", [None, "poet"])
def test_greedy_tokens_match_transformers(chats, adapter):
    """(a) the default adapter (adapter None) and (b) a lora_modules adapter selected per request."""
    vllm_chat, hf_chat, _, _ = chats
    for messages in PROMPTS:
        ours, theirs = vllm_chat.chat(messages, adapter=adapter)[0], hf_chat.chat(messages, adapter=adapter)[0]
        assert ours.token_ids == theirs.token_ids, messages
        assert (ours.finish_reason, ours.response_text) == (theirs.finish_reason, theirs.response_text)


def test_adapters_change_the_reply(chats):
    """The parity above would hold trivially if every adapter were ignored: they must differ."""
    vllm_chat, _, bare, _ = chats
    request = vllm_chat.request(PROMPTS[0])
    replies = [vllm_chat.chat(PROMPTS[0])[0].token_ids, vllm_chat.chat(PROMPTS[0], adapter="poet")[0].token_ids,
               vllm_chat._run(bare.generate(request))[0].token_ids]
    assert len({tuple(r[:8]) for r in replies}) == 3


def test_bare_base_matches_transformers(chats):
    """(c) no adapter at all: the base model's own greedy tokens."""
    vllm_chat, _, bare, hf_base = chats
    assert bare.adapters == ("default", "poet") and bare.default_adapter is None
    for messages in PROMPTS:
        request = vllm_chat.request(messages)
        ours = vllm_chat._run(bare.generate(request))  # the engine's loop: AsyncLLM is bound to it
        assert ours[0].token_ids == hf_base.chat(messages)[0].token_ids, messages


def test_stream_concatenates_to_the_reply(chats):
    vllm_chat, _, _, _ = chats
    for messages in PROMPTS:
        pieces = list(vllm_chat.stream_chat(messages, adapter="poet"))
        assert len(pieces) > 1  # deltas per step, not one final chunk
        assert "".join(pieces) == vllm_chat.chat(messages, adapter="poet")[0].response_text


def test_greedy_logprobs_match_transformers(chats):
    vllm_chat, hf_chat, _, _ = chats
    ours, theirs = vllm_chat.chat(PROMPTS[1], logprobs=3)[0], hf_chat.chat(PROMPTS[1], logprobs=3)[0]
    assert len(ours.logprobs) == len(theirs.logprobs) == len(ours.token_ids)
    for mine, ref in zip(ours.logprobs, theirs.logprobs):
        assert mine.token_id == ref.token_id
        assert mine.logprob == pytest.approx(ref.logprob, abs=1e-3)
        assert [t for t, _ in mine.top] == [t for t, _ in ref.top]
        assert [lp for _, lp in mine.top] == pytest.approx([lp for _, lp in ref.top], abs=1e-3)
        assert mine.top[0][0] == mine.token_id  # greedy: the chosen token is the most likely


def test_n_sampled_replies(chats):
    vllm_chat, _, _, _ = chats
    replies = vllm_chat.chat(PROMPTS[0], n=2, do_sample=True, temperature=1.0, seed=7)
    assert [r.index for r in replies] == [0, 1]
    assert all(len(r.token_ids) >= 1 for r in replies)
    assert replies[0].token_ids != replies[1].token_ids
    again = vllm_chat.chat(PROMPTS[0], n=2, do_sample=True, temperature=1.0, seed=7)
    assert [r.token_ids for r in again] == [r.token_ids for r in replies]  # the seed decides
    greedy = vllm_chat.chat(PROMPTS[0], n=2)
    assert greedy[0].token_ids == greedy[1].token_ids


def test_stop_string_cuts_and_aborts(chats):
    vllm_chat, _, _, _ = chats
    full = vllm_chat.chat(PROMPTS[1])[0].response_text
    stop = full[5:8]
    cut = vllm_chat.chat(PROMPTS[1], stop=[stop])[0]
    assert cut.response_text == full[: full.find(stop)] and cut.finish_reason == "stop"
    assert cut.response_length < 16
    assert vllm_chat.engine.llm.get_num_unfinished_requests() == 0  # the early exit aborted it in vLLM


def test_prompt_longer_than_the_window(chats):
    from stages.engines.types import PromptTooLong

    vllm_chat, _, _, _ = chats
    with pytest.raises(PromptTooLong):
        vllm_chat.chat([{"role": "user", "content": "sea " * MAXLEN}])


def test_adapter_rank_above_the_engine_limit(tmp_path, adapter_outputs):
    from cluster.api import ChatModel
    from stages.inference.loading import InferenceLoadError

    wide = make_adapter_output(tmp_path / "wide", seed=3, rank=16)
    with pytest.raises(InferenceLoadError, match="rank 16, above vllm_max_lora_rank 8"):
        ChatModel(_config(adapter_outputs, adapter_name_or_path=wide, infer_backend="vllm", vllm_max_lora_rank=8))


def test_stacked_adapters_need_an_export(adapter_outputs):
    from cluster.api import ChatModel
    from stages.inference.loading import InferenceLoadError

    both = f"{adapter_outputs['math']},{adapter_outputs['poet']}"
    with pytest.raises(InferenceLoadError, match="rayfactory export"):
        ChatModel(_config(adapter_outputs, adapter_name_or_path=both, infer_backend="vllm"))


def test_pause_holds_new_requests_until_resume(chats):
    """The hook RL needs to swap weights under a serving engine: while paused no token comes out;
    after resume the held request completes with the reply it would have had."""
    import asyncio
    import inspect
    import time

    vllm_chat, _, _, _ = chats
    engine = vllm_chat.engine
    request = vllm_chat.request(PROMPTS[0])

    async def first_token_seconds():  # the control: how soon an unpaused engine answers here
        start, stream = time.perf_counter(), engine.stream(request)
        await stream.__anext__()
        await stream.aclose()
        return time.perf_counter() - start

    async def paused_then_resumed(hold: float):
        await engine.pause()
        paused = engine.llm.is_paused()
        paused = await paused if inspect.isawaitable(paused) else paused
        stream = engine.stream(request)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(hold)
        held = not first.done()
        await engine.resume()
        delta = await first
        tokens = list(delta.token_ids)
        async for delta in stream:
            tokens += delta.token_ids
        return paused, held, tokens

    control = vllm_chat._run(first_token_seconds())
    paused, held, tokens = vllm_chat._run(paused_then_resumed(max(1.0, 20 * control)))
    assert paused and held, f"the first token came while paused (an unpaused one takes {control:.3f} s)"
    assert tokens == vllm_chat.chat(PROMPTS[0])[0].token_ids


def test_images_are_refused_with_the_fix(chats):
    """Images reach the model through the transformers engine only; vLLM says so, naming the setting
    that changes it, before anything is encoded or generated."""
    from pathlib import Path

    from stages.inference.chat_model import ChatInputError

    vllm_chat, _, _, _ = chats
    picture = Path(__file__).resolve().parents[2] / "data" / "shapes" / "shapes_eval_000.png"
    with pytest.raises(ChatInputError, match="infer_backend: huggingface"):
        vllm_chat.chat([{"role": "user", "content": "<image>What colour is the shape?"}], images=[str(picture)])
    assert vllm_chat.chat(PROMPTS[0])[0].token_ids  # the engine goes on answering


def test_eval_tasks_score_alike_on_vllm_and_transformers(chats):
    """rayfactory eval with infer_backend: vllm: vLLM's prompt log-probs give the multiple-choice task the
    transformers engine's log-likelihoods, and greedy generation the same replies."""
    from stages.inference.eval_args import EvaluationArguments
    from stages.inference.evaluation import evaluate

    vllm_chat, hf_chat, _, _ = chats
    args = EvaluationArguments(task="rf_arith_mc,rf_arith_gen", n_shot=1, eval_limit=6)
    ours, theirs = (evaluate(chat.spec, args, chat=chat) for chat in (vllm_chat, hf_chat))
    for doc, (mine, other) in enumerate(zip(ours["samples"]["rf_arith_mc"], theirs["samples"]["rf_arith_mc"])):
        for (ll_vllm, greedy_vllm), (ll_hf, greedy_hf) in zip([r[0] for r in mine["resps"]], [r[0] for r in other["resps"]]):
            assert abs(ll_vllm - ll_hf) < 5e-3, (doc, ll_vllm, ll_hf)  # per token 1e-3 at most (above)
            assert greedy_vllm == greedy_hf
    assert [r["resps"] for r in ours["samples"]["rf_arith_gen"]] == [r["resps"] for r in theirs["samples"]["rf_arith_gen"]]
