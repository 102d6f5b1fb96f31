"""DeepSpeed ZeRO-2/3 for the RL roles, without Ray, on CPU (gloo, one rank; two ranks in a
spawned pair): a ZeRO policy's update equals the plain one on the same batch, its exports and
saves are whole under ZeRO-3, its checkpoints resume exactly, and the config check lets
``deepspeed`` through to the roles.

The first DeepSpeed use on a machine compiles its shared-memory comm op (~60-90 s, cached in
~/.cache/torch_extensions); the tests share one process group per module.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

from cluster.config import load_config
from stages.rl.algorithms.grpo_math import loss_normalizer
from stages.rl.workers.policy import PolicyWorker
from stages.rl.config.types import RolloutSample

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA_DIR = os.path.join(REPO_ROOT, "data")
DS_DIR = os.path.join(REPO_ROOT, "configs", "deepspeed")
# Adam's first step with a huge epsilon is lr * g / eps: proportional to the gradient, so equal
# steps mean equal gradients (a plain Adam step is sign-like and would hide a wrongly scaled one).
STEP = {"adam_epsilon": 1e3, "learning_rate": 100.0}
TOLERANCE = 1e-5  # of the largest step: the ZeRO optimizers sum and clip in flat fp32 buffers


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """A one-rank gloo group, as fabric's actor groups give every policy rank (DeepSpeed joins it)."""
    import torch.distributed as dist

    # Put the environment back afterwards: RANK / WORLD_SIZE (and what DeepSpeed adds) left in the
    # pytest process reach every later test's subprocesses (the web UI's server then hangs on them).
    saved = dict(os.environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


def config(tmp_path, zero: int | str | None = None, **overrides) -> dict:
    """A grpo run on tiny:llama; ``zero``: 2 or 3 (the shipped ds_z{zero}_config.json) or a file
    name in configs/deepspeed."""
    out = {"model_name_or_path": "tiny:llama", "template": "llama3", "stage": "grpo", "finetuning_type": "full",
           "dataset": "arith_train", "dataset_dir": DATA_DIR, "output_dir": str(tmp_path / "out"),
           "reward_funcs": ["exact_match"], "rollout_backend": "hf", "max_grad_norm": 0.0, "seed": 3,
           "per_device_train_batch_size": 3, **STEP}
    if zero is not None:
        out["deepspeed"] = os.path.join(DS_DIR, zero if isinstance(zero, str) else f"ds_z{zero}_config.json")
    out.update(overrides)
    return out


def policy(tmp_path, zero: int | None = None, **overrides) -> PolicyWorker:
    worker = PolicyWorker(load_config(config(tmp_path, zero, **overrides)).job_spec())
    worker.setup(0, 1, total_updates=10)
    return worker


def samples(seed: int = 0) -> list[RolloutSample]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(7):  # three micro-batches of 3, 3, 1: the accumulation crosses a boundary
        prompt = torch.randint(5, 200, (3 + i % 3,), generator=generator).tolist()
        completion = torch.randint(5, 200, (2 + i % 4,), generator=generator).tolist()
        out.append(RolloutSample(prompt, completion, group=i // 2, advantage=float(i % 3) - 1.0))
    return out


def weights(worker: PolicyWorker) -> dict[str, torch.Tensor]:
    """The trainable weights, whole (ZeRO-3 shards gathered)."""
    from stages.rl.workers.zero import gathered

    with gathered(worker.model):
        return {n: p.detach().clone() for n, p in worker.model.named_parameters() if p.requires_grad}


def update(worker: PolicyWorker, batch=None) -> dict:
    batch = batch or samples()
    return worker.update(batch, loss_normalizer("grpo", [len(s.completion_ids) for s in batch], 32))


def max_step_gap(before, a_after, b_after) -> float:
    """The largest difference of two runs' steps from ``before``, relative to the largest step,
    less two float32 spacings of the weight: agreeing gradients can still leave a weight rounded
    one way in one run and the other way in another (as tests/stages/test_rl_policy.py forgives)."""
    scale = max((a_after[n] - before[n]).abs().max() for n in before)
    assert scale > 0
    gaps = []
    for n in before:
        largest = torch.maximum(a_after[n].abs(), b_after[n].abs())
        spacing = torch.nextafter(largest, torch.tensor(float("inf"))) - largest
        gaps.append(((a_after[n] - b_after[n]).abs() - 2 * spacing).clamp(min=0).max())
    return float(max(gaps) / scale)


@pytest.mark.parametrize("zero", [2, 3, "ds_z2_offload_config.json", "ds_z3_offload_config.json"])
def test_a_zero_update_equals_the_plain_one(tmp_path, zero):
    """Same batch, same start: the step of the ZeRO engine (three micro-batches, one boundary,
    gradient clipping by DeepSpeed) equals the plain AdamW step to TOLERANCE of the step; a
    different learning rate (the negative control) is far outside it. The offload configs too
    (on CPU the "host" is where the model already is: this checks the arithmetic, not the copies)."""
    clip = {"max_grad_norm": 0.05}  # below the gradient's norm: both clip
    plain = policy(tmp_path, **clip)
    start = weights(plain)
    plain_report = update(plain)
    plain_after = weights(plain)

    worker = policy(tmp_path, zero, **clip)
    assert worker.engine is not None
    assert (zero in (3, "ds_z3_offload_config.json")) == hasattr(next(worker.model.parameters()), "ds_id")
    assert all(torch.equal(start[n], w) for n, w in weights(worker).items())
    report = update(worker)
    assert report["micro_batches"] == plain_report["micro_batches"] == 3
    assert worker.engine.global_steps == 1  # three backwards, one optimizer step
    assert report["grad_norm"] == pytest.approx(plain_report["grad_norm"], rel=1e-5)
    assert report["grad_norm"] > 0.05  # so the clipping acted
    assert report["loss"] == pytest.approx(plain_report["loss"], rel=1e-6)
    assert report["lr"] == plain_report["lr"]
    assert max_step_gap(start, plain_after, weights(worker)) < TOLERANCE

    control = policy(tmp_path, zero, **{**clip, "learning_rate": 80.0})
    update(control)
    assert max_step_gap(start, plain_after, weights(control)) > 0.1


def test_a_zero3_lora_policy_reads_and_exports_whole_weights(tmp_path):
    """A LoRA policy under ZeRO-3 (every parameter a shard): its log-probs, reference log-probs
    (adapter off), HF-backend samples, merged export, adapter export and collective-push packing
    equal those of the same policy unsharded, after one update on each. Without the gather the
    export is of empty placeholders (the control)."""
    from safetensors.torch import load

    from fabric.weight_sync import WeightSender
    from stages.engines.types import SamplingSpec
    from stages.engines.weight_buckets import plan_bytes
    from stages.rl.workers.weights import bytes_to_state_dict, export_state_dict

    lora = {"finetuning_type": "lora", "lora_rank": 4, "beta": 0.04}
    plain, sharded = policy(tmp_path, **lora), policy(tmp_path, 3, **lora)
    assert plain.reference.kind == sharded.reference.kind == "adapter_disabled"
    batch = samples(1)
    for sample, ref in zip(batch, sharded.reference_logprobs(batch)):  # the KL term's (beta > 0)
        sample.ref_logprobs = ref
    start = weights(plain)
    update(plain, batch), update(sharded, batch)
    assert max_step_gap(start, weights(plain), weights(sharded)) < TOLERANCE

    for ask in ("logprobs", "reference_logprobs"):
        for a, b in zip(getattr(plain, ask)(batch), getattr(sharded, ask)(batch)):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4), ask
    sampling = SamplingSpec(n=2, max_tokens=6, temperature=1.0, seed=5, logprobs=0)
    prompts = [s.prompt_ids for s in batch[:2]]
    drawn = [(c.token_ids, c.logprobs) for c in plain.generate_batch(prompts, sampling)]
    for (tokens, logprobs), c in zip(drawn, sharded.generate_batch(prompts, sampling)):
        assert c.token_ids == tokens and torch.allclose(torch.tensor(c.logprobs), torch.tensor(logprobs), atol=1e-4)

    full, whole = bytes_to_state_dict(plain.export_weights()), bytes_to_state_dict(sharded.export_weights())
    assert full.keys() == whole.keys() and not any(".lora_" in n for n in whole)
    for name in full:
        assert whole[name].shape == full[name].shape and torch.allclose(whole[name], full[name], atol=1e-6), name
    adapter, sharded_adapter = load(plain.export_adapter()), load(sharded.export_adapter())
    assert adapter.keys() == sharded_adapter.keys() and adapter
    for name in adapter:
        assert torch.allclose(sharded_adapter[name], adapter[name], atol=1e-6), name

    sender = WeightSender()
    sender.join("127.0.0.1", _free_port(), 1, "gloo")  # a group of the sender alone: the packing is the point
    plan = sender.send(sharded.model)
    sender.flush()
    assert plan_bytes(plan) == sum(t.numel() * t.element_size() for t in full.values())

    ungathered = export_state_dict(sharded.model)  # the control: shards read without gathering
    assert all(t.numel() == 0 for n, t in ungathered.items() if n in full and full[n].numel() > 0)


@pytest.mark.parametrize("zero", [2, 3])
def test_a_zero_checkpoint_resumes_exactly(tmp_path, zero):
    """Save after a step, load into a fresh role: the next step (weights, optimizer moments, the
    warmed-up schedule's lr) is the uninterrupted run's, bit for bit; a role that did not load
    takes another step (the control). A plain (DDP-layout) checkpoint is refused by name."""
    from stages.training.checkpoints import ResumeError

    schedule = {"lr_scheduler_type": "linear", "warmup_steps": 2, "learning_rate": 1e-2, "adam_epsilon": 1e-8}
    folder = str(tmp_path / "checkpoint" / "policy")
    first = policy(tmp_path, zero, **schedule)
    update(first, samples(0))
    first.save_checkpoint(folder)
    assert os.path.isdir(os.path.join(folder, "zero")) and os.path.exists(os.path.join(folder, "rng_state_0.pt"))
    expected = update(first, samples(1))
    expected_weights = weights(first)

    resumed = policy(tmp_path, zero, **schedule)
    resumed.load_checkpoint(folder)
    report = update(resumed, samples(1))
    assert report["lr"] == expected["lr"] and report["loss"] == expected["loss"]
    for name, tensor in weights(resumed).items():
        assert torch.equal(tensor, expected_weights[name]), name

    fresh = policy(tmp_path, zero, **schedule)
    update(fresh, samples(1))
    assert any(not torch.equal(t, expected_weights[n]) for n, t in weights(fresh).items())

    plain_folder = str(tmp_path / "plain" / "policy")
    policy(tmp_path, **schedule).save_checkpoint(plain_folder)
    with pytest.raises(ResumeError, match="without deepspeed"):
        policy(tmp_path, zero, **schedule).load_checkpoint(plain_folder)
    with pytest.raises(ResumeError, match="DeepSpeed"):
        policy(tmp_path, **schedule).load_checkpoint(folder)


def test_a_zero3_critic_values_update_and_save_equal_the_plain_ones(tmp_path):
    """PPO's critic (a value head on the policy's model) under ZeRO-3: its values, one update and
    its saved folder (gathered) equal the plain critic's."""
    from safetensors.torch import load_file

    from stages.rl.workers.critic import CriticWorker
    from stages.training.value_head import VALUE_HEAD_FILE

    def critic(zero):
        worker = CriticWorker(load_config(config(tmp_path, zero, stage="ppo", critic_init="policy")).job_spec())
        worker.setup(0, 1, total_updates=10)
        return worker

    plain, sharded = critic(None), critic(3)
    batch = samples(2)
    values = plain.values(batch)
    for a, b in zip(values, sharded.values(batch)):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    generator = torch.Generator().manual_seed(5)
    for sample, row in zip(batch, values):
        sample.values = [v + 0.1 for v in row]
        sample.returns = torch.randn(len(sample.completion_ids), generator=generator).tolist()
    start = weights(plain)
    norm = float(sum(len(s.completion_ids) for s in batch))
    plain.update(batch, norm), sharded.update(batch, norm)
    assert max_step_gap(start, weights(plain), weights(sharded)) < TOLERANCE
    plain.save(str(tmp_path / "plain")), sharded.save(str(tmp_path / "sharded"))
    for name in (VALUE_HEAD_FILE, "model.safetensors"):
        a, b = (load_file(tmp_path / side / "critic" / name) for side in ("plain", "sharded"))
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a), name


def test_auto_values_are_filled_from_the_trainer_options_and_unknown_ones_named(tmp_path):
    from cluster.config_types import ConfigError
    from stages.rl.workers.zero import ZeroConfigError, engine_config

    spec = load_config(config(tmp_path, 3, max_grad_norm=0.7, per_device_train_batch_size=5)).job_spec()
    model = torch.nn.Linear(2, 2)
    model.config = type("Config", (), {"hidden_size": 8})()
    filled = engine_config(spec.training.values["deepspeed"], spec.training, 2, model, 1e-3, 10, 2)
    assert (filled["train_micro_batch_size_per_gpu"], filled["gradient_accumulation_steps"],
            filled["train_batch_size"], filled["gradient_clipping"]) == (5, 1, 10, 0.7)
    assert filled["bf16"]["enabled"] is False and filled["fp16"]["enabled"] is False  # a float32 model
    zero = filled["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (64, 57, 80)
    assert spec.training.values["deepspeed"]["train_batch_size"] == "auto"  # the run's own JSON untouched
    named = dict(spec.training.values["deepspeed"], optimizer={"type": "AdamW", "params": {"lr": "auto"}},
                 scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}})
    filled = engine_config(named, spec.training, 1, model, 1e-3, 10, 2)
    assert filled["optimizer"]["params"]["lr"] == 1e-3 and filled["scheduler"]["params"]["warmup_num_steps"] == 2
    unknown = dict(named, activation_checkpointing={"partition_activations": "auto"})
    with pytest.raises(ZeroConfigError, match="activation_checkpointing.partition_activations"):
        engine_config(unknown, spec.training, 1, model, 1e-3, 10, 2)
    path = tmp_path / "ds_unknown_auto.json"
    path.write_text(json.dumps(unknown))
    with pytest.raises(ConfigError, match="deepspeed in .*partition_activations"):  # before anything starts
        load_config(config(tmp_path, deepspeed=str(path)))


@pytest.mark.parametrize("stage", ["grpo", "ppo"])
def test_deepspeed_is_accepted_for_rl_stages_and_reaches_the_roles(tmp_path, stage):
    from cluster.config_types import ConfigError

    extra = {"reward_model": None} if stage == "ppo" else {}
    spec = load_config(config(tmp_path, 3, stage=stage, **extra)).job_spec()
    with open(os.path.join(DS_DIR, "ds_z3_config.json"), encoding="utf-8") as f:
        assert spec.training.values["deepspeed"] == json.load(f)  # the JSON itself, read where the run starts

    with pytest.raises(ConfigError) as info:  # what ZeRO-3 cannot do with several generating policy ranks
        load_config(config(tmp_path, 3, ray_num_workers=2, rollout_batch_size=2, num_generations=2))
    for word in ("deepspeed", "ZeRO-3", "rollout_backend", "ray_num_workers"):
        assert word in str(info.value), word
    load_config(config(tmp_path, 2, ray_num_workers=2, rollout_batch_size=2, num_generations=2))  # ZeRO-2: fine


# ----- two ranks over gloo, each in a process of its own -----

# padding-free (tiny:llama): rank 0's 4 samples of 5, 7, 9, 8 tokens take 4 forwards, rank 1's 6, 8, 7 three
TWO_RANKS = {"per_device_train_batch_size": 4, "max_tokens_per_micro_batch": 10}


def _rank(rank: int, port: int, folder: str, zero: int) -> None:
    """One of two policy ranks: the group fabric forms, setup, this rank's share of the batch."""
    import pathlib

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    worker = PolicyWorker(load_config(config(pathlib.Path(folder), zero, **TWO_RANKS)).job_spec())
    worker.setup(rank, 2, total_updates=10)
    batch = samples()
    mine = batch[:4] if rank == 0 else batch[4:]
    logprobs = worker.logprobs(mine)
    report = worker.update(mine, loss_normalizer("grpo", [len(s.completion_ids) for s in batch], 32))
    blob = worker.export_weights()  # every rank: the ZeRO-3 gather is collective
    worker.save(os.path.join(folder, "saved"))
    assert (blob is None) == (rank == 1)
    whole = weights(worker)  # a gather too: on both ranks
    torch.save({"logprobs": logprobs, "report": report, "weights": whole, "exported": blob},
               os.path.join(folder, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("zero", [2, 3])
def test_two_zero_ranks_step_as_one_plain_process(tmp_path, zero):
    """Two ranks over gloo, 4 and 3 samples split by a token budget into 4 and 3 micro-batches
    (the second rank runs an idle one so that the ranks' gathers and reductions pair up): their
    log-probs and their one ZeRO step equal one plain process's on all 7 samples; rank 0's export
    (gathered with rank 1) and the saved model are the whole, updated weights."""
    import multiprocessing

    from transformers import AutoModelForCausalLM

    from stages.rl.workers.weights import bytes_to_state_dict, export_state_dict

    plain = policy(tmp_path, **TWO_RANKS)
    start = weights(plain)
    batch = samples()
    expected_logprobs = plain.logprobs(batch)
    expected = update(plain, batch)
    context = multiprocessing.get_context("spawn")
    port = _free_port()
    ranks = [context.Process(target=_rank, args=(rank, port, str(tmp_path), zero)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=300)
    for process in ranks:
        if process.is_alive():  # a hang (the ranks' collectives out of step): fail, do not wait on
            process.kill()
    assert [p.exitcode for p in ranks] == [0, 0]
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]

    got = results[0]["logprobs"] + results[1]["logprobs"]
    assert all(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5) for a, b in zip(got, expected_logprobs))
    assert [r["report"]["micro_batches"] for r in results] == [4, 3]
    assert sum(r["report"]["loss"] for r in results) / 2 == pytest.approx(expected["loss"], rel=1e-5)
    assert max_step_gap(start, weights(plain), results[0]["weights"]) < TOLERANCE
    exported = bytes_to_state_dict(results[0]["exported"])
    for name, tensor in export_state_dict(plain.model).items():
        assert torch.allclose(exported[name], tensor, atol=1e-5), name
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32).state_dict()
    for name, tensor in exported.items():
        assert torch.equal(saved[name], tensor), name
