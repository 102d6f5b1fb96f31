"""Tools and environments for multi-turn rollouts: schemas, calls, the registry, module:Class specs."""

import json
import logging
import socket
import sys
import textwrap
import types
import uuid
from dataclasses import replace

import pytest

from registries.errors import UserError
from registries.templates.tools import FunctionCall, get_tool_format, parse_tools
from stages.rl.agents.environments import (
    ENVIRONMENTS,
    Environment,
    EnvironmentSpecError,
    StepResult,
    ToolEnvironment,
    check_step,
    load_environment,
)
from stages.rl.agents import sandbox
from stages.rl.agents import tools as tools_module
from stages.rl.agents.sandbox import SandboxLimits
from stages.rl.agents.sandbox_cgroup import CgroupUnavailable
from stages.rl.agents.tools import (
    TOOLS,
    Tool,
    ToolError,
    calculator,
    evaluate,
    load_tools,
    observation_turn,
    register_tool,
    run_tool_calls,
    tool,
    tools_json,
)

USER_MODULE = "rf_test_user_tools"
USER_SOURCE = '''
from stages.rl.agents.environments import Environment, StepResult
from stages.rl.agents.tools import tool


@tool("Reverse a string.", {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})
def reverse(text):
    return text[::-1]


@tool("Also named reverse.", {"type": "object", "properties": {}}, name="reverse")
def other_reverse():
    return ""


def plain_function(text):
    return text


class GuessEnv(Environment):
    """Guess the row's number: 'higher'/'lower' until right (reward 1) or three tries (reward 0)."""

    def __init__(self, tries=3):
        self.tries = tries

    def reset(self, row):
        self.answer, self.turns = int(row["reference"]), 0
        return [{"role": "user", "content": "Guess my number."}]

    def step(self, action):
        self.turns += 1
        guess = int(action.strip())
        if guess == self.answer:
            return StepResult(None, 1.0, True)
        if self.turns >= self.tries:
            return StepResult(None, 0.0, True)
        return StepResult("higher" if guess < self.answer else "lower", 0.0, False)
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / f"{USER_MODULE}.py").write_text(textwrap.dedent(USER_SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield USER_MODULE
    sys.modules.pop(USER_MODULE, None)


@pytest.mark.parametrize("expression, value", [
    ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("7 / 2", "3.5"), ("6 / 3", "2"), ("-2 ** 2", "-4"),
    ("17 // 5 + 17 % 5", "5"), ("123456789 * 987654321", "121932631112635269"), ("2 ** 0.5", str(2 ** 0.5)),
])
def test_calculator_computes(expression, value):
    assert calculator({"expression": expression}) == value


@pytest.mark.parametrize("expression, error", [
    ("__import__('os').system('true')", "only numbers"),
    ("open('/etc/passwd')", "only numbers"),
    ("(1).__class__", "only numbers"),
    ("x + 1", "only numbers"),
    ("9 ** 9 ** 9", "exponents above"),
    ("1 / 0", "ZeroDivisionError"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 +", "not an arithmetic expression"),
    ("1" * 300, "longer than"),
    ("'a' * 3", "only numbers"),
])
def test_calculator_refuses_anything_but_arithmetic(expression, error):
    result = calculator({"expression": expression})
    assert result.startswith("Error:") and error in result


def test_evaluate_never_calls_eval():
    with pytest.raises(ValueError, match="only numbers"):
        evaluate("[1, 2]")


def test_tool_calls_and_their_errors_are_observations():
    assert calculator('{"expression": "1+1"}') == "2"
    assert calculator("not json").startswith("Error: the arguments of calculator are not JSON")
    assert calculator("[1]") == "Error: the arguments of calculator must be a JSON object, got list."
    assert calculator({}) == "Error: calculator takes ['expression']; missing ['expression']."
    assert "unknown ['x']" in calculator({"expression": "1", "x": 2})
    calls = [FunctionCall("calculator", '{"expression": "6*7"}'), FunctionCall("search", "{}")]
    results = run_tool_calls(calls, [calculator])
    assert results == ["42", "Error: there is no tool 'search'; the tools are ['calculator']."]
    assert observation_turn(results) == {"role": "observation", "content": "42\n" + results[1]}


def test_the_python_tool_runs_in_the_sandbox(isolated):
    assert TOOLS["python"]({"code": "print(sum(range(10)))"}) == "45\n"
    failed = TOOLS["python"]({"code": "1/0"})
    assert "ZeroDivisionError" in failed
    assert TOOLS["python"]({"code": "x = 1"}) == "(no output)"


def test_the_python_tool_reaches_neither_the_network_nor_the_host_files(isolated, tmp_path):
    """From inside the tool: a connection to a host listener and a read of a host file. The host
    sees no connection, and the file's text is nowhere in the observation."""
    secret = f"secret-{uuid.uuid4().hex}"
    (tmp_path / "notes.txt").write_text(secret)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    code = textwrap.dedent(f"""
        import socket
        try:
            socket.create_connection(("127.0.0.1", {listener.getsockname()[1]}), timeout=1).sendall(b"hi")
            print("connected")
        except OSError as exc:
            print("no connection:", exc.strerror)
        print(open({str(tmp_path / "notes.txt")!r}).read())
    """)
    try:
        observation = TOOLS["python"]({"code": code})
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()
    assert observation.startswith("no connection: Network is unreachable\n"), observation
    assert "FileNotFoundError" in observation and secret not in observation


SMALL = SandboxLimits(wall_seconds=15.0, cpu_seconds=1, memory_bytes=128 << 20, max_output_bytes=4096,
                      file_size_bytes=1 << 20, disk_bytes=4 << 20, max_processes=8)


@pytest.mark.parametrize("code, stopped", [
    ("while True: pass", "the CPU-time limit (1 s)"),
    ("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass", "the CPU-time limit (1 s)"),
    ("b = bytearray(200 << 20)", "the memory limit (128 MiB for all its processes together)"),
    ("import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        b = bytearray(50 << 20)\n"
     "        time.sleep(1)\n        os._exit(0)\nos.wait()", "the memory limit (128 MiB for all its processes together)"),
    ("print('x' * 100000)", "the output limit (4 KiB)"),
    ("open('f', 'wb').write(b'a' * (2 << 20))", "the file-size limit (1 MiB per file)"),
    ("for i in range(10):\n    open(f'f{i}', 'wb').write(b'a' * (900 << 10))",
     "disk full: the work directory's size limit (4 MiB)"),
    ("import os\nwhile True:\n    os.fork()", "the process limit (8 processes)"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "killed by SIGSEGV"),
], ids=["cpu", "cpu-sigxcpu-ignored", "memory", "memory-of-the-tree", "output", "file-size", "disk",
        "processes", "signal"])
def test_the_python_tool_says_what_stopped_a_program(isolated, monkeypatch, code, stopped):
    monkeypatch.setattr(tools_module, "PYTHON_TOOL_LIMITS", SMALL)  # 15 s wall: CPU seconds, even on a busy machine
    observation = TOOLS["python"]({"code": code})
    assert observation.endswith(f"\n[stopped: {stopped}]"), observation


def test_the_python_tool_says_the_wall_clock_stopped_a_sleeper(isolated, monkeypatch):
    monkeypatch.setattr(tools_module, "PYTHON_TOOL_LIMITS", replace(SMALL, wall_seconds=1.0))
    observation = TOOLS["python"]({"code": "import time; time.sleep(30)"})
    assert observation == "\n[stopped: the wall-clock limit (1 s)]"


def test_load_tools_holds_the_python_tool_to_the_configs_sandbox(monkeypatch, tmp_path, caplog):
    """isolated: refused (a ToolError naming the piece and the opt-in) where a piece is missing,
    and every call refused too; unisolated: runs, with a warning."""
    def no_cgroup(*args):
        raise CgroupUnavailable("no cgroup hierarchy offers the memory controller")
    monkeypatch.setattr(sandbox, "make_cgroup", no_cgroup)
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)  # as root, so the cgroup is the missing piece
    with pytest.raises(ToolError, match=r"Tool 'python'.*memory and pids cgroup.*`sandbox: unisolated`"):
        load_tools(["calculator", "python"], sandbox="isolated")
    marker = tmp_path / "ran"
    refused = TOOLS["python"]({"code": f"open({str(marker)!r}, 'w').write('ran')"})
    assert refused.startswith("Error: SandboxUnavailable:") and not marker.exists()
    with caplog.at_level(logging.WARNING, logger="stages.rl.agents.tools"):
        calculator_tool, python_tool = load_tools(["calculator", "python"], sandbox="unisolated")
    assert "WITHOUT isolation" in caplog.text
    assert calculator_tool is calculator and python_tool({"code": "print(6 * 7)"}) == "42\n"
    assert load_tools(["python"]) == [TOOLS["python"]]  # no sandbox named (a config check): found, not run


def test_a_runs_sandbox_key_reaches_its_python_tool(monkeypatch, caplog):
    """RLArguments.sandbox -> Episodes -> environment_factory -> load_tools: the key decides."""
    from stages.rl.controller.episodes import environment_factory
    from stages.rl.config.rl_args import RLArguments

    assert RLArguments().sandbox == "isolated"
    def no_cgroup(*args):
        raise CgroupUnavailable("none here")
    monkeypatch.setattr(sandbox, "make_cgroup", no_cgroup)
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    template = types.SimpleNamespace(extract_tool_calls=lambda reply: [])
    with pytest.raises(ToolError, match="memory and pids cgroup: none here"):
        environment_factory("tools", {}, ["python"], template, sandbox="isolated")
    with caplog.at_level(logging.WARNING, logger="stages.rl.agents.tools"):
        env = environment_factory("tools", {}, ["python"], template, sandbox="unisolated")()
    assert "WITHOUT isolation" in caplog.text and env.tools[0]({"code": "print(6 * 7)"}) == "42\n"


def test_schemas_render_through_every_template_tool_format():
    text = tools_json([calculator, TOOLS["python"]])
    assert [t["function"]["name"] for t in json.loads(text)] == ["calculator", "python"]
    assert parse_tools(text) == json.loads(text)
    for fmt in ("default", "qwen", "llama3"):
        rendered = get_tool_format(fmt).format_tools(parse_tools(text))
        assert "calculator" in rendered and "python" in rendered


def test_a_qwen_reply_round_trips_to_an_observation():
    fmt = get_tool_format("qwen")
    reply = fmt.format_calls([FunctionCall("calculator", '{"expression": "12*12"}')])
    env = ToolEnvironment([calculator], fmt.extract_calls)
    assert env.reset({"prompt": "What is 12*12?", "reference": "144"}) == "What is 12*12?"
    assert env.step(reply) == StepResult("144", 0.0, False)
    assert env.step("The answer is 144.") == StepResult(None, 0.0, True)


def test_registry_rejects_duplicates_and_bad_tools():
    with pytest.raises(ValueError, match="already registered"):
        register_tool(calculator)
    with pytest.raises(ValueError, match="takes a Tool"):
        register_tool(lambda: 1)
    bad = Tool("a:b", "", {"type": "object"}, lambda: "")
    with pytest.raises(ValueError, match="free of ':'"):
        register_tool(bad)
    with pytest.raises(ToolError, match="JSON schema object"):
        tool("no schema", {"properties": {}})


def test_load_tools_from_builtins_and_modules(user_module):
    tools = load_tools(["calculator", f"{user_module}:reverse"])
    assert [t.name for t in tools] == ["calculator", "reverse"]
    assert tools[1]({"text": "abc"}) == "cba"
    with pytest.raises(ToolError, match=r"give the names \['reverse'\] more than once"):
        load_tools([f"{user_module}:reverse", f"{user_module}:other_reverse"])
    with pytest.raises(ToolError, match="is a function, not a Tool"):
        load_tools([f"{user_module}:plain_function"])
    with pytest.raises(ToolError, match=r"Unknown tool 'nope'\. Built-ins: \['calculator', 'python'"):
        load_tools(["nope"])
    with pytest.raises(ToolError, match="module 'rf_no_such_module' was not found") as info:
        load_tools(["rf_no_such_module:x"])
    assert isinstance(info.value, UserError)
    assert load_tools([f"{user_module}:reverse"], run_modules=False) == []  # found, not run


def test_a_user_environment_from_module_class(user_module):
    env = load_environment(f"{user_module}:GuessEnv")(tries=3)
    assert isinstance(env, Environment)
    assert env.reset({"prompt": "", "reference": "7"}) == [{"role": "user", "content": "Guess my number."}]
    observation, reward, done = env.step("3")
    assert (observation, reward, done) == ("higher", 0.0, False)
    assert env.step("9") == ("lower", 0.0, False)
    assert env.step("7") == (None, 1.0, True)
    assert load_environment("tools") is ToolEnvironment and "tools" in ENVIRONMENTS


def test_environment_errors_name_the_spec(user_module):
    with pytest.raises(EnvironmentSpecError, match=r"Unknown environment 'nope'.*'module\.path:Class'"):
        load_environment("nope")
    with pytest.raises(EnvironmentSpecError, match=f"'{user_module}:Missing': module '{user_module}' has no"):
        load_environment(f"{user_module}:Missing")
    with pytest.raises(EnvironmentSpecError, match="needs the row's 'prompt'"):
        ToolEnvironment([], lambda r: r).reset({"question": "?"})
    assert check_step("e", ("obs", 1, 0)) == StepResult("obs", 1.0, False)
    with pytest.raises(EnvironmentSpecError, match=r"Environment 'e': step\(\) returned 3"):
        check_step("e", 3)
    with pytest.raises(EnvironmentSpecError, match="observation of type dict"):
        check_step("e", ({"a": 1}, 0.0, False))


def test_the_calculator_demo_data_shows_the_tool_as_the_rl_loop_renders_it():
    """calc_tool_sft's tools column is tools_json([calculator]) to the byte, so the sft warm start
    and the RL run put the same system prompt before the question; its observations are what the
    tool returns for the demonstrated call."""
    import json as _json

    from registries.synthetic.calculator import TOOLS_TEXT, demonstrations, problems
    from stages.rl.agents.tools import calculator, tools_json

    assert TOOLS_TEXT == tools_json([calculator])
    for row in demonstrations(problems("t", 20)):
        _, call, observation, answer = row["conversations"]
        arguments = _json.loads(call["value"])["arguments"]
        assert calculator(arguments) == observation["value"] == answer["value"]
