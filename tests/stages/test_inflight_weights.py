"""Partial rollouts without an engine: the gate that lets a weight push in between two decoding
steps, and the keys that turn it on. The engine itself (a real vLLM, token by token) is
tests/e2e/test_partial_rollout.py's; a GRPO run with it, tests/e2e/test_grpo_async.py's."""

from __future__ import annotations

import threading
import time

import pytest

from cluster.config import ConfigError, load_config
from stages.engines.inflight_weights import StepGate
from stages.engines.types import Completion
from tests.stages.test_async_rollouts import GRPO


def test_a_waiting_load_goes_before_the_next_decoding_step():
    gate, order = StepGate(), []

    def take(name: str, load: bool) -> None:
        with gate.turn(load=load):
            order.append(name)

    load = threading.Thread(target=take, args=("load", True))
    step = threading.Thread(target=take, args=("step", False))
    with gate.turn(load=False):  # a step in progress
        load.start()
        while gate._loads_waiting == 0:
            time.sleep(0.001)
        step.start()  # the loop's next step asks for the engine after the load did
        time.sleep(0.05)
        assert order == []  # neither runs during the step
    load.join()
    step.join()
    assert order == ["load", "step"]


def test_turns_never_overlap_and_loads_are_counted_once_done():
    gate, inside, most = StepGate(), [0], [0]

    def work(load: bool) -> None:
        for _ in range(200):
            with gate.turn(load=load):
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                inside[0] -= 1
                if load:
                    gate.loaded()

    threads = [threading.Thread(target=work, args=(load,)) for load in (False, True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1 and gate.loads == 200


def test_a_batch_waits_for_the_pushes_sent_before_it_and_says_which_never_came():
    gate = StepGate()
    gate.wait_for_loads(0, timeout_s=0.01)  # nothing to wait for
    threading.Timer(0.05, gate.loaded).start()
    gate.wait_for_loads(1, timeout_s=10)
    assert gate.loads == 1
    with pytest.raises(TimeoutError, match="weight push 2 .*loaded 1"):
        gate.wait_for_loads(2, timeout_s=0.05)


def test_share_of_tokens_sampled_after_a_push():
    from fabric.rl_roles import share_after_push

    completions = [Completion([1, 2, 3, 4], versions=[3, 3, 4, 4]), Completion([5, 6], versions=[3, 3])]
    assert share_after_push(completions, 3) == pytest.approx(2 / 6)
    assert share_after_push(completions, 4) == 0.0
    assert share_after_push([Completion([1])], 0) == 0.0  # unstamped (a batch without partial rollouts)


def test_the_key_and_its_mistakes():
    assert load_config({**GRPO, "async_rollout": "one_step", "partial_rollout": True}).rl.partial_rollout
    assert load_config(GRPO).rl.partial_rollout is False
    with pytest.raises(ConfigError, match="partial_rollout") as caught:
        load_config({**GRPO, "partial_rollout": True})  # synchronous: nothing is ever in flight
    assert "async_rollout: one_step" in str(caught.value)
    with pytest.raises(ConfigError, match="swaps the LoRA") as caught:
        load_config({**GRPO, "async_rollout": "one_step", "partial_rollout": True, "rollout_lora_sync": "adapter"})
    assert "rollout_lora_sync: merged" in str(caught.value)
    collective = {**GRPO, "async_rollout": "bounded", "partial_rollout": True, "rollout_weight_sync": "collective"}
    assert load_config(collective).rl.partial_rollout


def test_an_adapter_push_cannot_be_in_flight():
    """Where the pushes go and how they are counted is tested on a real engine actor
    (tests/e2e/test_partial_rollout.py); here only the refusal, which needs none."""
    from fabric.weight_sync import CollectiveSync, ObjectStoreSync

    assert ObjectStoreSync().in_flight is False and CollectiveSync("gloo").in_flight is False
    assert ObjectStoreSync(in_flight=True).loads_sent == 0
    with pytest.raises(ValueError, match="full weights only"):
        ObjectStoreSync(payload="adapter", in_flight=True)
