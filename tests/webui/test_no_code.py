"""The web UI runs no code a request names (issue 63): keys that import Python, change how Ray starts
processes or trust a model's own code are refused unless the UI was started with --allow-code, and
then only modules that are files in the UI's folder; checking a config never imports anything.
Every path-like key of the typed config is confined, a folder is never reached through a spelling
taken for a hub id, and the Chat and Export tabs answer a bad model or adapter with a 4xx, offline."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.webui.test_hardening import BASE_URL, OUTSIDE, refused

MARKER = "imported.txt"
# A module that, if anything imports it, leaves a file behind (and would run any command it liked).
EVIL_MODULE = f"open({MARKER!r}, 'w').write('ran')\n\ndef score(prompts, completions, **kw):\n    return [0.0] * len(completions)\n"
GRPO = {"stage": "grpo", "finetuning_type": "full", "model_name_or_path": "tiny:qwen2", "dataset": "arith_train",
        "dataset_dir": "data", "output_dir": "saves/run"}


def make_client(cwd, allow_code=False):
    from fastapi.testclient import TestClient

    from cluster.webui.server import create_app

    return TestClient(create_app(str(cwd / "share"), cwd=str(cwd), allow_code=allow_code), base_url=BASE_URL,
                      raise_server_exceptions=False)


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """The UI's folder: the repo's data (symlinked), a module that marks its import, a package whose
    __init__ marks its import, and the process's cwd moved there (where a module would be imported from)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    repo_data = os.path.join(os.path.dirname(__file__), "..", "..", "data")
    (cwd / "data").mkdir()
    for name in ("dataset_info.json", "arith_train.json"):
        shutil.copy(os.path.join(repo_data, name), cwd / "data" / name)
    (cwd / "evil_rewards.py").write_text(EVIL_MODULE)
    (cwd / "evilpkg").mkdir()
    (cwd / "evilpkg" / "__init__.py").write_text(EVIL_MODULE)
    (cwd / "evilpkg" / "rewards.py").write_text("def score(prompts, completions, **kw):\n    return [0.0]\n")
    monkeypatch.chdir(cwd)
    return cwd


def form_body(config: dict) -> dict:
    """The body the page sends for ``config``: its form fields, and the rest in the "more keys" box."""
    from cluster.webui import form

    values, extra = form.form_from_config(config)
    return {"values": values, "extra_text": form.extra_text(extra)}


def config_error(client, **extra):
    answer = client.post("/api/config", json=form_body({**GRPO, **extra}))
    assert answer.status_code == 200, answer.text
    return answer.json()["error"]


@pytest.mark.parametrize("extra,key", [
    ({"environment": "os:system", "environment_kwargs": {"command": "touch pwned"}}, "environment"),
    ({"reward_funcs": ["evil_rewards:score"]}, "reward_funcs"),
    ({"reward_funcs": ["exact_match", "evilpkg.rewards:score"]}, "reward_funcs"),
    ({"reward_funcs": ["exact_match"], "tools": ["evil_rewards:score"]}, "tools"),
    ({"reward_funcs": ["exact_match"], "ray_init_kwargs": {"runtime_env": {"py_executable": "sh -c 'touch pwned' sh"}}},
     "ray_init_kwargs"),
    ({"reward_funcs": ["exact_match"], "trust_remote_code": True}, "trust_remote_code"),
])
def test_keys_that_name_code_are_refused_without_the_opt_in(folder, extra, key):
    client = make_client(folder)
    error = config_error(client, **extra)
    assert error is not None and "--allow-code" in error["message"], error
    body = form_body({**GRPO, **extra})
    for route in ("/api/runs", "/api/yaml/save", "/api/preview"):  # refused before a job, a file or a tokenizer
        answer = client.post(route, json={**body, "dataset": "arith_train"})
        assert answer.status_code == 400 and "--allow-code" in answer.json()["error"], (route, answer.text)
    assert not (folder / MARKER).exists() and not (folder / "pwned").exists()
    assert not (folder / "share" / "configs").exists() or not os.listdir(folder / "share" / "configs")


def test_built_in_names_need_no_opt_in(folder):
    client = make_client(folder)
    assert config_error(client, reward_funcs=["exact_match"]) is None
    assert config_error(client, reward_funcs=["exact_match"], tools=["calculator", "python"]) is None


def test_with_the_opt_in_a_module_in_the_folder_is_found_but_never_imported(folder):
    client = make_client(folder, allow_code=True)
    assert config_error(client, reward_funcs=["evil_rewards:score"]) is None
    assert config_error(client, reward_funcs=["evilpkg.rewards:score"]) is None  # its package's __init__ not run
    assert not (folder / MARKER).exists(), "checking the config imported the module"
    error = config_error(client, reward_funcs=["evil_rewards:nothing_here"]) or {}
    assert not (folder / MARKER).exists()  # the attribute is the job's to check: finding never imports
    assert error.get("key") in (None, "reward_funcs")


@pytest.mark.parametrize("spec", ["os:system", "subprocess:run", "json:loads", "cluster.cli:main", "nosuchmodule:f",
                                  "../evil_rewards:score", "evil_rewards.py:score"])
def test_with_the_opt_in_only_modules_inside_the_folder_run(folder, spec):
    client = make_client(folder, allow_code=True)
    error = config_error(client, environment=spec, reward_funcs=["exact_match"])
    assert error is not None and error["key"] == "environment", (spec, error)


def test_with_the_opt_in_ray_init_kwargs_stay_in_the_folders_and_run_no_command(folder, tmp_path):
    client = make_client(folder, allow_code=True)
    for kwargs in ({"runtime_env": {"py_executable": "python"}}, {"runtime_env": {"pip": ["evil"]}},
                   {"runtime_env": {"working_dir": str(tmp_path)}}, {"_temp_dir": "/tmp/elsewhere"},
                   {"runtime_env": {"py_modules": ["../outside"]}}):
        error = config_error(client, reward_funcs=["exact_match"], ray_init_kwargs=kwargs)
        assert error is not None and "ray_init_kwargs" in error["message"], (kwargs, error)
    assert config_error(client, reward_funcs=["exact_match"],
                        ray_init_kwargs={"runtime_env": {"env_vars": {"A": "1"}, "working_dir": "."}}) is None


def test_finding_a_module_runs_none_of_its_packages(folder, monkeypatch):
    """stages.rl.config.specs.module_file: importlib.util.find_spec("evilpkg.rewards") would import evilpkg."""
    import sys

    from stages.rl.config.specs import module_file

    assert module_file("evilpkg.rewards", [str(folder)]) == str(folder / "evilpkg" / "rewards.py")
    monkeypatch.syspath_prepend(str(folder))
    assert module_file("evilpkg.rewards") == str(folder / "evilpkg" / "rewards.py")
    assert module_file("evil_rewards.score") is None  # a module has no submodules
    assert module_file("evilpkg.nothing") is None and module_file("bad name") is None and module_file("") is None
    assert not (folder / MARKER).exists() and "evilpkg" not in sys.modules


def test_every_path_like_key_of_the_typed_config_is_confined(folder):
    """path_keys() is read from the typed config, so a field added later is confined too: each one it
    finds, set outside the UI's folders, is refused and named."""
    from cluster.webui.paths import path_keys

    keys = path_keys()
    for known in ("output_dir", "dataset_dir", "ray_storage_path", "cache_dir", "deepspeed", "export_dir",
                  "tokenized_path", "resume_from_checkpoint"):
        assert known in keys, known
    client = make_client(folder)
    for key in keys:
        for value in ("/etc/rf-outside", "../outside/x"):
            answer = client.post("/api/config", json=form_body({key: value}))
            error = answer.json()["error"]
            assert error is not None and OUTSIDE in error["message"] and key in error["message"], (key, value, error)
    for value in ("s3://bucket/runs", "gs://bucket/runs"):  # remote storage is not a local path
        answer = client.post("/api/config", json=form_body({"ray_storage_path": value}))
        assert OUTSIDE not in str(answer.json()["error"]), value


@pytest.mark.parametrize("key", ["model_name_or_path", "adapter_name_or_path", "ref_model", "reward_model",
                                 "resume_from_checkpoint"])
def test_a_local_folder_is_never_reached_through_a_hub_id_spelling(folder, key):
    """After /api/yaml/save made a folder named 'x:', 'x://../../outside' reached outside."""
    client = make_client(folder)
    assert client.post("/api/yaml/save", json={"values": {}, "path": "x:/made.yaml"}).status_code == 200
    assert (folder / "x:").is_dir()
    for value in ("x://../../outside/adapter", "x:/../../outside", "file:///../../etc", "org/../../outside"):
        answer = client.post("/api/config", json=form_body({key: value}))
        error = answer.json()["error"]
        assert error is not None and OUTSIDE in error["message"], (key, value, error)


# Model and adapter strings a client may send: every one gets a 4xx (never a 500, never the network).
BAD_NAMES = [
    "file:///etc", "a:b", "tiny:nonexistent", "org/", "/", ".", "..", "x://../../outside", "demo:nope", "tiny:",
    "demo:", ":", "::", "a/b/c", "org/name", "name", "~", "~root", "http://127.0.0.1:9/x", "tiny:qwen2/../..",
    "\u00e9t\u00e9", "a" * 300, "tiny:qwen2,", ",", "tiny:qwen2,tiny:llama", "share", "share/configs", "x:",
    "C:\\x", "org/name/rev", "-", "_", "tiny:QWEN2", "gpt2", "Qwen/Qwen2-0.5B", "data", "data/dataset_info.json",
    "evil_rewards.py", " x", "a\tb", "org//name", "org/name/", "/etc/passwd", "/proc/self", "/dev/null",
    "../", "./", "~/.cache", "%2e%2e/x", "..\\x", "a\nb", "hf://org/name", "s3://b/m", "tiny:llava,", "demo:x:y",
]


@pytest.mark.parametrize("route", ["/api/chat", "/api/export"])
def test_bad_model_and_adapter_names_get_a_4xx_offline(folder, route):
    import time

    client = make_client(folder)
    (folder / "x:").mkdir()
    codes = {}
    for key in ("model_name_or_path", "adapter_name_or_path"):
        for name in BAD_NAMES:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 1, "export_dir": "out", key: name}
            if key == "adapter_name_or_path":
                body["model_name_or_path"] = "tiny:qwen2"
            start = time.monotonic()
            answer = client.post(route, json=body)
            codes[answer.status_code] = codes.get(answer.status_code, 0) + 1
            assert 400 <= answer.status_code < 500, (key, name, answer.status_code, answer.text)
            assert time.monotonic() - start < 20, (key, name, "slow: a network retry?")
    assert sum(codes.values()) == 2 * len(BAD_NAMES)
