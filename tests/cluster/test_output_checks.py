"""cluster/output_checks.py: output_dir (and a local ray_storage_path) must be writable and hold one
checkpoint, checked before Ray starts.

The estimate is compared with parameter counts worked out by hand from the tiny model's config.
The filesystem cases are real: small tmpfs mounts, full or remounted read-only (this needs root
with CAP_SYS_ADMIN; elsewhere those tests skip, and fail under CI=true), driven through ``run_exp``
as a user would.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest

from cluster.config import ConfigError, load_config
from cluster.driver import run_exp
from cluster.output_checks import (
    CheckpointEstimate,
    check_free_space,
    check_writable,
    estimate_checkpoint,
    human_bytes,
    local_storage_path,
)
from stages.loading import resolve_model_path
from tests.ci import skip_or_fail_in_ci
from tests.e2e.conftest import tiny_sft_config


def tiny_counts() -> tuple[int, int]:
    """(all parameters, LoRA rank-8 parameters on every linear layer) of tiny:qwen2, from its config."""
    with open(os.path.join(resolve_model_path("tiny:qwen2"), "config.json"), encoding="utf-8") as f:
        c = json.load(f)
    hidden, inter, vocab, layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    q, k, v, o = (hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden)  # (in, out)
    mlp = [(hidden, inter), (hidden, inter), (inter, hidden)]  # gate, up, down
    per_layer = (hidden * hidden + hidden) + 2 * (hidden * kv + kv) + hidden * hidden  # q, k, v with biases; o
    per_layer += 3 * hidden * inter + 2 * hidden  # mlp, two RMSNorms
    embeddings = vocab * hidden * (1 if c["tie_word_embeddings"] else 2)
    total = embeddings + layers * per_layer + hidden  # + the final norm
    lora = layers * sum(8 * (n_in + n_out) for n_in, n_out in [q, k, v, o, *mlp])
    return total, lora


def estimate(tmp_path, **overrides) -> CheckpointEstimate:
    return estimate_checkpoint(load_config(tiny_sft_config(tmp_path / "out", **overrides)))


def test_the_estimate_of_full_lora_and_freeze(tmp_path):
    total, lora = tiny_counts()
    assert (total, lora) == (205632, 16384)  # the tiny model these numbers describe

    full = estimate(tmp_path)  # float32 weights, AdamW: 4 + 2 x 4 bytes per parameter
    assert (full.weights, full.optimizer, full.total) == (4 * total, 8 * total, 12 * total)

    adapter = estimate(tmp_path, finetuning_type="lora", lora_rank=8)  # the adapter alone, in float32
    assert (adapter.saved_params, adapter.trainable_params, adapter.total) == (lora, lora, 12 * lora)

    # freeze with the last layer trainable: the whole model is saved, one layer has optimizer state.
    layer = (total - 2 * 1026 * 64 - 64) // 2
    freeze = estimate(tmp_path, finetuning_type="freeze", freeze_trainable_layers=1)
    assert (freeze.weights, freeze.optimizer) == (4 * total, 8 * layer)


def test_the_estimate_follows_dtype_and_optimizer(tmp_path):
    total, _ = tiny_counts()
    assert estimate(tmp_path, bf16=True).total == 2 * total + 2 * 2 * total  # bfloat16 weights and AdamW state
    assert estimate(tmp_path, torch_dtype="float16").total == 6 * total
    assert estimate(tmp_path, save_only_model=True).total == 4 * total  # no optimizer state saved
    assert estimate(tmp_path, optim="sgd").optimizer == 0  # not counted for optimizers other than Adam's kind


def test_describe_and_human_bytes():
    assert human_bytes(512) == "512 bytes"
    assert human_bytes(65536) == "64.00 KiB (65536 bytes)"
    assert human_bytes(2467584) == "2.35 MiB (2467584 bytes)"
    assert human_bytes(3 * 1024**3) == "3.00 GiB (3221225472 bytes)"
    estimate = CheckpointEstimate(saved_params=1000, weight_bytes=2, trainable_params=100, optimizer_states=2,
                                  state_bytes=4)
    assert estimate.total == 2000 + 800
    assert estimate.describe() == ("1.95 KiB (2000 bytes) of weights (1,000 parameters x 2 bytes) + 800 bytes of "
                                   "optimizer state (2 x 100 trainable parameters x 4 bytes)")


def test_local_storage_path():
    assert local_storage_path("/data/ray") == "/data/ray"
    assert local_storage_path("file:///data/ray") == "/data/ray"
    assert local_storage_path("s3://bucket/ray") is None
    assert local_storage_path(None) is None


def test_writable_folders_pass_and_keep_no_probe(tmp_path):
    check_writable(str(tmp_path / "new" / "out"), "output_dir")
    assert os.listdir(tmp_path / "new" / "out") == []


def test_a_file_in_the_way_is_a_config_error(tmp_path):
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(ConfigError) as error:
        check_writable(str(tmp_path / "taken"), "output_dir")
    assert str(error.value) == (
        f"output_dir {tmp_path / 'taken'} cannot be written: File exists (EEXIST). Point output_dir at a folder "
        "this user can create and write files in. Nothing was trained: this was checked before Ray started."
    )


def test_free_space_counts_one_checkpoint_per_folder_on_a_filesystem(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    stats = os.statvfs(tmp_path)
    free = stats.f_bavail * stats.f_frsize
    half = CheckpointEstimate(saved_params=free // 2 - 1, weight_bytes=1, trainable_params=0, optimizer_states=0,
                              state_bytes=4)
    check_free_space([("output_dir", str(tmp_path / "a"))], half)
    check_free_space([("output_dir", str(tmp_path / "a")), ("ray_storage_path", str(tmp_path / "b"))], half)
    more = CheckpointEstimate(saved_params=free // 2 + 4096 * 1024, weight_bytes=1, trainable_params=0,
                              optimizer_states=0, state_bytes=4)
    check_free_space([("output_dir", str(tmp_path / "a"))], more)  # fits alone...
    with pytest.raises(ConfigError) as error:  # ...but not twice on one filesystem
        check_free_space([("output_dir", str(tmp_path / "a")), ("ray_storage_path", str(tmp_path / "b"))], more)
    assert str(error.value).startswith(
        f"output_dir {tmp_path / 'a'} and ray_storage_path {tmp_path / 'b'} share a filesystem with ")
    assert f"needs at least 2 x {human_bytes(more.total)} (each gets a copy of every checkpoint)" in str(error.value)


# ----- real filesystems, through run_exp -----

@pytest.fixture
def tmpfs(tmp_path):
    """mount(name, size) -> a fresh tmpfs of that size at tmp_path/name; unmounted afterwards."""
    mounted = []

    def mount(name: str, size: str = "64k"):
        folder = tmp_path / name
        folder.mkdir()
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                                  capture_output=True, text=True)
            why = done.stderr.strip() if done.returncode != 0 else None
        except FileNotFoundError:
            why = "no mount command"
        if why is not None:  # a developer's machine skips; CI must run these (tests/ci.py)
            skip_or_fail_in_ci(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {why}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in reversed(mounted):
        subprocess.run(["umount", str(folder)], check=True)


def read_only(folder) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True, capture_output=True)


def fill(folder) -> None:
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    assert os.statvfs(folder).f_bavail == 0


def refused(config) -> str:
    """run_exp's ConfigError; Ray must not have been started for it."""
    import ray

    was_up = ray.is_initialized()
    with pytest.raises(ConfigError) as error:
        run_exp(config)
    assert ray.is_initialized() == was_up, "Ray was started before the output folders were checked"
    return str(error.value)


def test_a_read_only_output_dir_fails_before_training(tmpfs, tmp_path):
    mount = tmpfs("ro")
    (mount / "out").mkdir()
    read_only(mount)
    out = mount / "out"
    message = refused(tiny_sft_config(out, ray_storage_path=str(tmp_path / "ray")))
    assert message.startswith(f"output_dir {out} cannot be written: Read-only file system (EROFS, at {out}/.rayfactory")
    assert "Its filesystem is mounted read-only: point output_dir at a folder on a writable filesystem" in message


def test_an_output_dir_on_a_full_filesystem_fails_before_training(tmpfs, tmp_path):
    mount = tmpfs("full")
    fill(mount)
    out = mount / "out"
    message = refused(tiny_sft_config(out, ray_storage_path=str(tmp_path / "ray")))
    assert message.startswith(f"output_dir {out} cannot be written: No space left on device (ENOSPC")
    assert "Its filesystem is full: free space there, or point output_dir at a filesystem with room" in message


def test_an_output_dir_too_small_for_one_checkpoint_fails_with_the_numbers(tmpfs, tmp_path):
    out = tmpfs("small", size="64k") / "out"
    total, _ = tiny_counts()
    message = refused(tiny_sft_config(out, ray_storage_path=str(tmp_path / "ray")))
    stats = os.statvfs(out)
    free = stats.f_bavail * stats.f_frsize
    assert free == 65536  # an empty 64k tmpfs
    assert message == (
        f"output_dir {out} is on a filesystem with 64.00 KiB (65536 bytes) free, but one checkpoint of this run "
        f"needs at least 2.35 MiB ({12 * total} bytes): 803.25 KiB ({4 * total} bytes) of weights (205,632 "
        f"parameters x 4 bytes) + 1.57 MiB ({8 * total} bytes) of optimizer state (2 x 205,632 trainable parameters "
        "x 4 bytes). Free space there, point output_dir at a filesystem with more room, or make checkpoints smaller "
        "(finetuning_type: lora saves only the adapter; save_only_model: true leaves out the optimizer state). "
        "Nothing was trained: this was checked before Ray started."
    )
    # The same run as lora needs 12 x 16,384 bytes = 192 KiB: still too much for 64 KiB, now by the adapter alone.
    lora = refused(tiny_sft_config(out, finetuning_type="lora", ray_storage_path=str(tmp_path / "ray")))
    assert "needs at least 192.00 KiB (196608 bytes): 64.00 KiB (65536 bytes) of weights (16,384 parameters" in lora


def test_a_read_only_ray_storage_path_fails_before_training(tmpfs, tmp_path):
    mount = tmpfs("ray")
    read_only(mount)
    message = refused(tiny_sft_config(tmp_path / "out", ray_storage_path=str(mount / "runs")))
    assert message.startswith(f"ray_storage_path {mount / 'runs'} cannot be written: Read-only file system (EROFS")
    assert "point ray_storage_path at a folder on a writable filesystem" in message
