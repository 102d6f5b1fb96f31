"""The ``rayfactory`` command, run as a real subprocess (``python -m cluster.cli``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import cluster
from cluster.cli import main
from registries.errors import UserError, find_user_error
from registries.datasets.errors import DatasetRowError
from registries.templates import list_templates

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rayfactory(*args: str, cwd: str = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO, "RAY_ADDRESS": ""}
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_version_is_instant_and_imports_nothing_heavy():
    done = rayfactory("version")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"rayfactory {cluster.__version__}\n", "")
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, cluster.cli as c; c.main(['version']); "
         "print(sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=60,
    )
    assert probe.stdout == f"rayfactory {cluster.__version__}\n[]\n"


def test_the_command_exits_after_other_threads_and_atexit_handlers_finish():
    """console_main ends the process with os._exit (no interpreter teardown): what a normal exit
    still does must happen first, and what was printed must reach a pipe."""
    script = (
        "import atexit, sys, threading, time\n"
        "sys.argv = ['rayfactory', 'version']\n"
        "from cluster.cli import console_main\n"  # imported first: on a loaded machine it can take 0.5 s
        "atexit.register(lambda: print('atexit handler ran'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.5), print('thread finished'))).start()\n"
        "console_main()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"rayfactory {cluster.__version__}\nthread finished\natexit handler ran\n"


def test_templates_lists_each_name_with_what_it_is_verified_against():
    from registries.templates import UNVERIFIED, verification_source

    done = rayfactory("templates")
    assert (done.returncode, done.stderr) == (0, "")
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list_templates()
    shown = {name: rest.strip() for name, rest in (line.split(None, 1) for line in lines)}
    assert shown == {name: verification_source(name) or UNVERIFIED for name in list_templates()}
    # the sources start in one column
    assert len({line.index(shown[line.split()[0]]) for line in lines}) == 1
    assert shown["llama3"].startswith("trl chat_templates/llama3.jinja") and "(tokens" in shown["llama3"]
    assert shown["mistral"].startswith("mistral-common")
    for unverified in ("alpaca", "vicuna", "default", "empty", "chatml"):
        assert shown[unverified] == "unverified (no independent oracle shipped by a package)"


def test_bad_config_exits_2_with_one_paragraph(tmp_path):
    (tmp_path / "cfg.yaml").write_text("model_name_or_path: m\noutput_dir: o\nlora_rnak: 16\n")
    done = rayfactory("train", "cfg.yaml", cwd=str(tmp_path))
    assert done.returncode == 2
    assert done.stdout == ""
    assert "rayfactory: error: unknown key 'lora_rnak' in cfg.yaml; did you mean 'lora_rank'?" in done.stderr
    assert "Traceback" not in done.stderr


def test_bad_override_exits_2(tmp_path, monkeypatch, capsys):
    # In-process main(): the same code path as the console script, without a second torch import.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text("model_name_or_path: m\noutput_dir: o\n")
    assert main(["train", "cfg.yaml", "lora_rank=eight"]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", (
        "rayfactory: error: wrong type for 'lora_rank' in command-line override 'lora_rank=eight': got 'eight' "
        "(a string), expected an integer.\n"
    ))


def test_missing_config_file_exits_2(tmp_path):
    done = rayfactory("train", "missing.yaml", cwd=str(tmp_path))
    assert done.returncode == 2
    expected = f"rayfactory: error: config file missing.yaml not found (looked for {tmp_path / 'missing.yaml'})"
    assert expected in done.stderr


def test_no_command_prints_usage_and_exits_2():
    done = rayfactory()
    assert done.returncode == 2
    assert done.stderr.startswith("usage: rayfactory [-h] [--version] COMMAND ...")
    assert "train" in done.stderr and "templates" in done.stderr


def test_a_command_without_its_config_file_says_one_is_needed_with_an_example(capsys):
    import pytest

    with pytest.raises(SystemExit) as exited:
        main(["train"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "rayfactory train: error: a config file is needed (a YAML file of LLaMA-Factory's keys, as in configs/), "
        "e.g. `rayfactory train configs/quickstart.yaml`; key=value overrides may follow it.")
    assert "key=value" not in err.splitlines()[-1].split("needed")[0]  # not "required: config, key=value"
    for command in ("chat", "export", "serve", "api", "submit", "webchat"):
        with pytest.raises(SystemExit):
            main([command])
        assert f"error: a config file is needed (a YAML file of LLaMA-Factory's keys, as in configs/), e.g. " \
               f"`rayfactory {command} configs/quickstart.yaml" in capsys.readouterr().err


def test_every_command_and_option_has_a_description():
    import argparse

    from cluster.cli import build_parser

    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    summaries = {choice.dest: choice.help for choice in commands._choices_actions}
    for name, parser in commands.choices.items():
        assert summaries[name] and parser.description, f"rayfactory {name} has no description"
        for action in parser._actions:
            assert action.help, f"rayfactory {name} {'/'.join(action.option_strings) or action.dest} has no help"


def test_env_reports_versions_without_starting_ray():
    from importlib import metadata

    done = rayfactory("env")
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(None, 1) for line in done.stdout.splitlines())
    for name in ("torch", "transformers", "peft", "trl", "datasets", "accelerate", "ray"):
        assert lines[name] == metadata.version(name)
    assert lines["python"].startswith(f"{sys.version_info.major}.{sys.version_info.minor}.")
    assert lines["accelerator"] == "CPU only (no CUDA device visible to torch)" or "CUDA device" in lines["accelerator"]
    # Without --local nothing is started: either another session's Ray is found, named with why that
    # one (issue 62), or we say how to get one.
    assert re.match(r"connected to [\w.:\[\]-]+ \((RAY_ADDRESS=|the newest Ray head|a Ray that Ray found)", lines["cluster"]) \
        or lines["cluster"] == "no running cluster found (set RAY_ADDRESS, or pass --local to start a temporary one)", \
        lines["cluster"]


def test_user_errors_raised_inside_ray_tasks_are_unwrapped():
    from ray.exceptions import RayTaskError

    cause = DatasetRowError("demo", "data/demo.json", 3, "output", "column 'output' is a list, expected a string")
    wrapped = RayTaskError("map_batches", "Traceback (most recent call last): ...", cause).as_instanceof_cause()
    assert str(find_user_error(wrapped)) == (
        "row 3 of data/demo.json (dataset 'demo'): column 'output' is a list, expected a string. "
        "Fix the row, or set skip_bad_rows: true to drop such rows and report them."
    )
    assert find_user_error(RuntimeError("a bug")) is None  # bugs keep their traceback


def test_every_user_error_class_shares_one_base():
    """The CLI, a Serve app and the web UI tell a user mistake from a bug by this one base class."""
    from cluster.config import ConfigError
    from registries.datasets.errors import DataConfigError
    from registries.errors import ArgumentError
    from stages.training.adapters import AdapterError
    from stages.run_args import TrainingOptionsError

    for cls in (ConfigError, DataConfigError, DatasetRowError, AdapterError, TrainingOptionsError, ArgumentError):
        assert issubclass(cls, UserError), cls


def test_a_key_or_dataset_typo_is_reported_before_torch_transformers_or_ray_are_imported(tmp_path):
    """Issue 62: a config mistake took 8.5-13 s to report, most of it importing torch and transformers
    for the trainer's option types. The trainer's key names are kept per transformers version in
    RayFactory's cache (listed once, cold), so a typo is named with none of them imported; the
    figures are in benchmarks/README.md (benchmarks/config_errors.py)."""
    probe = ("import sys, cluster.cli as c\n"
             "code = c.main(sys.argv[1:])\n"
             "print(code, sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))\n")
    env = {**os.environ, "PYTHONPATH": REPO, "RAY_ADDRESS": "", "RAYFACTORY_CACHE": str(tmp_path / "cache")}
    config = os.path.join(REPO, "configs", "sft_full.yaml")

    def run(*overrides):
        done = subprocess.run([sys.executable, "-c", probe, "train", config, *overrides], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)
        return done.stdout.strip().splitlines()[-1], done.stderr

    cold, _ = run("learning_ratee=1")  # the first run on this install lists the trainer's fields
    assert cold.startswith("2 ") and "transformers" in cold
    for override, word in (("learning_ratee=1", "did you mean 'learning_rate'"), ("dataset=arith_trian", "arith_train")):
        printed, stderr = run(override)
        assert printed == "2 []", (override, printed)
        assert word in stderr, stderr
