"""``rayfactory chat``: the real command, driven in a terminal (tmux) and through a pipe, checked
against greedy replies computed in-process by ChatModel for the same conversations."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests.ci import skip_or_fail_in_ci

from .conftest import BASE, TEMPLATE, make_adapter_output

REPO = Path(__file__).resolve().parents[2]
BANNER_END = "Ctrl-C stops a reply."
# Messages to choose from: the tiny random model answers some of them with control characters
# (form feeds, tabs) that a terminal does not show as text, so the test picks ones whose replies
# read back from the screen exactly.
CANDIDATES = ["tell me a story", "hello", "hi", "good morning", "why", "name a color", "ok", "count to three"]
FOLLOW_UPS = ["thanks", "and then?", "more please", "go on", "why not", "say it again"]


def _rayfactory() -> list[str]:
    script = Path(sys.executable).with_name("rayfactory")
    return [str(script)] if script.exists() else [sys.executable, "-m", "cluster.cli"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


def _screen_safe(text: str) -> bool:
    return bool(text.strip()) and text.isprintable() and "\ufffd" not in text and text == text.rstrip()


@pytest.fixture(scope="module")
def chat_setup(tmp_path_factory):
    """The config, and the messages with their in-process greedy replies: one turn, and two turns
    where the second reply differs from what the follow-up alone gets (so it proves history)."""
    from cluster.api import ChatModel

    root = tmp_path_factory.mktemp("chat_cli")
    adapter = make_adapter_output(root / "adapter", seed=1)
    config = root / "cfg.yaml"
    config.write_text(yaml.safe_dump({"model_name_or_path": BASE, "adapter_name_or_path": adapter,
                                      "template": TEMPLATE, "do_sample": False, "max_new_tokens": 8}))
    model = ChatModel(str(config))
    try:
        reply = lambda messages: model.chat(messages)[0].response_text  # noqa: E731
        for first in CANDIDATES:
            one = reply([{"role": "user", "content": first}])
            if not _screen_safe(one):
                continue
            for second in FOLLOW_UPS:
                turns = [{"role": "user", "content": first}, {"role": "assistant", "content": one},
                         {"role": "user", "content": second}]
                two = reply(turns)
                if _screen_safe(two) and two != reply(turns[2:]):
                    return {"config": config, "root": root, "first": first, "second": second, "one": one, "two": two}
    finally:
        model.close()
    pytest.fail("no candidate conversation has replies a terminal shows as plain text; extend CANDIDATES")


# --- the interactive command in a real terminal -------------------------------------------------


class _Tmux:
    def __init__(self, width: int = 200, height: int = 50):
        self.socket = f"rf-chat-{uuid.uuid4().hex[:8]}"  # a private server: never touches the user's tmux
        self.session, self.width, self.height = "chat", width, height

    def tmux(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", "-L", self.socket, "-f", "/dev/null", "-u", *args],
                              capture_output=True, text=True, check=check, env=_env())

    def start(self, command: str, cwd: Path) -> None:
        self.tmux("new-session", "-d", "-s", self.session, "-x", str(self.width), "-y", str(self.height),
                  "-c", str(cwd), command)

    def lines(self) -> list[str]:
        out = self.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", self.session, check=False).stdout
        return [line.rstrip() for line in out.splitlines()]

    def send(self, text: str) -> None:
        self.tmux("send-keys", "-t", self.session, "-l", text)
        self.tmux("send-keys", "-t", self.session, "Enter")

    def alive(self) -> bool:
        return self.tmux("has-session", "-t", self.session, check=False).returncode == 0

    def wait_for_prompts(self, count: int, timeout: float) -> list[str]:
        """The screen once it shows ``count`` "User:" prompts and waits at an empty one."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = [line for line in self.lines() if line]
            if sum(line.startswith("User:") for line in lines) == count and lines[-1] == "User:":
                return lines
            if not self.alive():
                break
            time.sleep(0.2)
        pytest.fail(f"no prompt #{count} within {timeout:.0f} s; the screen shows:\n" + "\n".join(self.lines()))

    def kill(self) -> None:
        self.tmux("kill-server", check=False)


def _last_reply(lines: list[str]) -> str:
    replies = [line for line in lines if line.startswith("Assistant: ")]
    assert replies, "no Assistant line on the screen:\n" + "\n".join(lines)
    return replies[-1][len("Assistant: "):]


@pytest.fixture(scope="module")
def tmux_installed():
    """The terminal test's terminal: skips without tmux, fails under CI=true (tests/ci.py)."""
    if shutil.which("tmux") is None:
        skip_or_fail_in_ci("tmux is not installed (Debian: apt-get install tmux; scripts/install_system_packages.sh "
                           "does it and the test command runs that)")


def test_chat_in_a_terminal_streams_keeps_history_clears_and_exits(tmux_installed, chat_setup):
    setup = chat_setup
    rc_file = setup["root"] / "tmux_rc"
    command = " ".join(_rayfactory()) + f" chat {setup['config']}"
    term = _Tmux()
    try:
        term.start(f"env PYTHONPATH={REPO} LANG=C.UTF-8 {command}; echo $? > {rc_file}", cwd=setup["root"])
        banner = term.wait_for_prompts(1, timeout=300)
        assert f"adapter   {setup['root'] / 'adapter'}" in banner and "template  qwen" in banner
        assert "backend   huggingface" in banner and banner[-2].endswith(BANNER_END)

        term.send(setup["first"])
        assert _last_reply(term.wait_for_prompts(2, timeout=120)) == setup["one"]
        term.send(setup["second"])  # answered with the first exchange in the history
        assert _last_reply(term.wait_for_prompts(3, timeout=120)) == setup["two"]
        term.send("clear")
        assert term.wait_for_prompts(4, timeout=30)[-2] == "History has been removed."
        term.send(setup["first"])  # a fresh conversation again
        assert _last_reply(term.wait_for_prompts(5, timeout=120)) == setup["one"]

        term.send("exit")
        deadline = time.monotonic() + 60  # interpreter teardown after a torch session takes seconds
        while term.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not term.alive(), "the session is still running after `exit`"
        assert rc_file.read_text().strip() == "0"
    finally:
        term.kill()


# --- the same command through a pipe, and its user errors ---------------------------------------


def test_chat_from_a_pipe_prints_the_transcript_and_exits_0_at_eof(chat_setup):
    setup = chat_setup
    too_long = "word " * 300  # past the 200-token window set below: said in a line, then the session goes on
    lines = [too_long, setup["first"], "", setup["second"], "clear", setup["first"]]
    done = subprocess.run([*_rayfactory(), "chat", str(setup["config"]), "vllm_maxlen=200"],
                          input="\n".join(lines) + "\n", capture_output=True, text=True, env=_env(),
                          cwd=setup["root"], timeout=600)
    assert done.returncode == 0, done.stderr
    banner, sep, transcript = done.stdout.partition(BANNER_END + "\n")
    assert sep and f"model     {BASE}" in banner
    refused, _, transcript = transcript.partition("\n")
    error, _, transcript = transcript.partition("\n")
    assert refused == "User: Assistant: "
    assert error.startswith("rayfactory: the prompt is ") and "context window is 200 tokens" in error
    assert error.endswith("Type `clear` to start a new conversation.")
    # input() writes its prompt without a newline when stdin is a pipe; the empty line re-prompts.
    # The refused message is not in the history: the next reply is the one-turn reply.
    assert transcript == (f"User: Assistant: {setup['one']}\n"
                          f"User: User: Assistant: {setup['two']}\n"
                          "User: History has been removed.\n"
                          f"User: Assistant: {setup['one']}\n"
                          "User: \n")
    assert "Loading" not in done.stderr and "Traceback" not in done.stderr


def test_a_missing_model_folder_is_one_error_paragraph_with_exit_2(tmp_path):
    key = "model_name_or_path"
    values = {"template": TEMPLATE, key: str(tmp_path / "nowhere" / "model")}
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(values))
    done = subprocess.run([*_rayfactory(), "chat", str(config)], input="hello\n", capture_output=True, text=True,
                          env=_env(), cwd=tmp_path, timeout=300)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith(f"rayfactory: error: {key} '{tmp_path / 'nowhere' / 'model'}' does not exist")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_the_example_chat_config_runs_without_a_trained_output():
    from cluster.api import ChatModel

    model = ChatModel(str(REPO / "configs" / "inference" / "tiny_chat.yaml"))
    try:
        assert (model.spec.inference.infer_backend, model.template.name, model.adapters) == ("huggingface", "qwen", ())
        first, again = (model.chat([{"role": "user", "content": "hello"}])[0] for _ in range(2))
        assert first.response_length == len(first.token_ids) >= 1 and first.token_ids == again.token_ids  # greedy
        assert first.response_length == 32 or first.finish_reason == "stop"
    finally:
        model.close()
