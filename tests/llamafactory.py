"""LLaMA-Factory 0.9.5 as a reference for parity tests: a script run in its own venv, JSON back
(one worker process for the whole pytest run).

The venv is the one benchmarks/vs_llamafactory.py uses (``~/.cache/rayfactory/lf-0.9.5``): built on
first use from PyPI (CPU torch first, then llamafactory==0.9.5), as the template tests fetch their
tokenizers once, and reused after. Where it cannot be built the test skips, except in CI, where it
fails: a parity check the suite claims is never silently left out.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import tempfile
from pathlib import Path

from tests.bench import load_benchmark
from tests.ci import skip_or_fail_in_ci
from tests.locks import cache_lock

REPO_ROOT = Path(__file__).resolve().parent.parent
LF_VENV = Path.home() / ".cache" / "rayfactory" / "lf-0.9.5"
LF_PYTHON = LF_VENV / "bin" / "python"


def llamafactory_python() -> Path:
    """The python of the LLaMA-Factory venv, building it the first time (minutes)."""
    if LF_PYTHON.exists() and (LF_VENV / "bin" / "llamafactory-cli").exists():
        return LF_PYTHON
    with cache_lock("lf-venv"):  # another xdist worker may be building it: wait, then use theirs
        try:
            load_benchmark("vs_llamafactory").ensure_lf_venv(str(LF_VENV))
        except Exception as exc:  # no network, no disk: a skip here, a failure in CI
            skip_or_fail_in_ci(f"the LLaMA-Factory 0.9.5 venv at {LF_VENV} is missing and could not be built: {exc}")
    return LF_PYTHON


# One LLaMA-Factory process serves every parity reference of a pytest run: importing llamafactory
# (torch, transformers, its data and model modules) is most of a reference's cost, so the scripts
# are sent to one long-lived interpreter, one JSON line each way. A script reads its payload from
# sys.argv[1] and prints its JSON answer last, as it would run alone under ``python -c``.
_WORKER = r"""
import contextlib, io, json, os, sys, traceback
replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # anything else written to stdout (a library's print, C code) goes to stderr
for line in sys.stdin:
    request = json.loads(line)
    os.chdir(request["cwd"])
    sys.argv = ["-c", json.dumps(request["payload"])]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(request["script"], "<parity script>", "exec"), {"__name__": "__main__"})
        reply = {"ok": True, "result": json.loads(printed.getvalue().strip().splitlines()[-1])}
    except BaseException:
        reply = {"ok": False, "error": traceback.format_exc()}
    replies.write(json.dumps(reply) + "\n")
    replies.flush()
"""
_worker: subprocess.Popen | None = None


def _llamafactory_worker() -> subprocess.Popen:
    global _worker
    if _worker is None or _worker.poll() is not None:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", DISABLE_VERSION_CHECK="1", HF_HUB_OFFLINE="1")
        log = tempfile.NamedTemporaryFile(prefix="llamafactory-worker-", suffix=".log", delete=False)
        _worker = subprocess.Popen([str(llamafactory_python()), "-c", _WORKER], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        _worker.log_path = log.name
        atexit.register(_worker.kill)
    return _worker


def run_in_llamafactory(script: str, payload: dict, timeout: float = 300) -> dict:
    """Run ``script`` (reading its JSON payload from argv[1]) in the LLaMA-Factory venv's one worker
    process, in this process's working directory; the JSON object it prints last."""
    worker = _llamafactory_worker()
    worker.stdin.write(json.dumps({"script": script, "payload": payload, "cwd": os.getcwd()}) + "\n")
    worker.stdin.flush()
    ready, _, _ = select.select([worker.stdout], [], [], timeout)
    line = worker.stdout.readline() if ready else ""
    if not line:
        worker.kill()
        log = Path(worker.log_path).read_text(errors="replace")[-2000:]
        raise AssertionError(f"the LLaMA-Factory worker gave no answer in {timeout} s (exit {worker.poll()}):\n{log}")
    reply = json.loads(line)
    assert reply["ok"], reply.get("error", "")[-3000:]
    return reply["result"]


# ------------------------------------------------------------------ LLaMA-Factory's example YAMLs

# The keys of LLaMA-Factory's examples/train_lora/*.yaml (as of its main branch, 2026), model aside:
# the tests put a tiny: model (or a local folder) in model_name_or_path and read our data/, whose
# stand-ins carry LLaMA-Factory's demo dataset names (registries/synthetic/lf_demos.py).
_LORA = dict(do_train=True, finetuning_type="lora", lora_rank=8, lora_target="all", cutoff_len=2048,
             max_samples=1000, preprocessing_num_workers=16, logging_steps=10, save_steps=500, plot_loss=True,
             overwrite_output_dir=True, per_device_train_batch_size=1, gradient_accumulation_steps=8,
             num_train_epochs=3.0, lr_scheduler_type="cosine", warmup_ratio=0.1, bf16=True, ddp_timeout=180000000)
_QWEN3 = dict(_LORA, trust_remote_code=True, template="qwen3_nothink", dataloader_num_workers=4, report_to="none")
LF_LORA_EXAMPLES: dict[str, dict] = {
    "qwen3_lora_sft": dict(_QWEN3, stage="sft", dataset="identity", learning_rate=1.0e-4, save_only_model=False,
                           resume_from_checkpoint=None),
    "qwen3_lora_dpo": dict(_QWEN3, stage="dpo", pref_beta=0.1, pref_loss="sigmoid", dataset="dpo_en_demo",
                           learning_rate=5.0e-6, save_only_model=False, resume_from_checkpoint=None),
    "qwen3_lora_kto": dict(_QWEN3, stage="kto", pref_beta=0.1, dataset="kto_en_demo", learning_rate=5.0e-6),
    "qwen3_lora_reward": dict(_QWEN3, stage="rm", dataset="dpo_en_demo", learning_rate=1.0e-4, save_only_model=False,
                              resume_from_checkpoint=None),
    "qwen3_lora_pretrain": {**{k: v for k, v in _QWEN3.items() if k != "template"}, "stage": "pt",
                            "dataset": "c4_demo", "learning_rate": 1.0e-4, "save_only_model": False,
                            "resume_from_checkpoint": None},
    "llama3_lora_sft": dict(_LORA, trust_remote_code=True, stage="sft", dataset="identity,alpaca_en_demo",
                            template="llama3", overwrite_cache=True, learning_rate=1.0e-4),
    "qwen2vl_lora_sft": dict(_LORA, trust_remote_code=True, image_max_pixels=262144, video_max_pixels=16384,
                             stage="sft", dataset="mllm_demo,identity,alpaca_en_demo", template="qwen2_vl",
                             overwrite_cache=True, dataloader_num_workers=4, save_only_model=False,
                             resume_from_checkpoint=None, learning_rate=1.0e-4),
}
# The tiny: model standing in for each example's (Qwen3-4B-Instruct-2507, Llama-3-8B-Instruct, Qwen2-VL-7B-Instruct).
LF_TINY_MODELS = {"qwen3": "tiny:qwen3", "llama3": "tiny:llama", "qwen2vl": "tiny:qwen2_vl"}


def lf_example(name: str, model: str | None = None, **overrides) -> dict:
    """LLaMA-Factory's example ``name`` on ``model`` (default: its tiny: stand-in) and our data/."""
    config = dict(LF_LORA_EXAMPLES[name])
    config["model_name_or_path"] = model or LF_TINY_MODELS[name.split("_")[0]]
    config["dataset_dir"] = str(REPO_ROOT / "data")
    config.update(overrides)
    return config


def tiny_qwen3_with_its_tokenizer() -> Path:
    """A 2-layer random-init Qwen3 with Qwen3's genuine tokenizer (151,669 ids; the npm package the
    template tests use, tests/registries/conftest.py), tied embeddings as Qwen3-4B has: built once
    into $RAYFACTORY_CACHE/tiny and reused. Its vocabulary turns chunked_loss on, as on a real Qwen3."""
    import shutil
    import tempfile

    from registries.models.tiny import cache_root, publish_folder
    from tests.registries.conftest import fetch_npm_tokenizer

    final = cache_root() / "tiny" / "qwen3-genuine-tokenizer-v1"
    if final.is_dir():
        return final
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(fetch_npm_tokenizer("qwen3"))
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.chmod(0o755)
        publish_folder(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
