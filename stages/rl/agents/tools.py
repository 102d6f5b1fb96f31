"""Tools a policy can call during a multi-turn rollout: plain Python functions with a JSON schema.

A ``Tool`` pairs a function with its OpenAI function schema, the shape the templates render into
the system prompt (registries/templates/tools.py ``parse_tools`` accepts it) and the shape a
``/v1/chat/completions`` request's ``tools`` carries::

    @tool("Add two integers.", {"type": "object", "properties": {"a": {"type": "integer"},
                                 "b": {"type": "integer"}}, "required": ["a", "b"]})
    def add(a, b):
        return a + b

The rollout loop renders ``tools_json(tools)`` into the prompt (``template.encode_multiturn(...,
tools=...)``), parses a reply with ``template.extract_tool_calls`` (``FunctionCall``s) and appends
``observation_turn(run_tool_calls(calls, tools))``. A tool's failure (bad arguments, an exception,
an unknown name) is an observation the policy reads, never a crash of the run: models learn from it.

Configs name tools as reward functions are named: a built-in (``calculator``, ``python``) or
``"module.path:attribute"`` where the attribute is a ``Tool`` (what ``@tool`` returns).
"""

from __future__ import annotations

import ast
import json
import logging
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Union

from registries.errors import UserError
from registries.synthetic.calculator import CALCULATOR
from registries.templates.tools import FunctionCall
from registries.unique import add_unique

from .sandbox import SandboxLimits, SandboxUnavailable, check_isolation, run_python
from stages.rl.config.specs import resolve_spec

logger = logging.getLogger(__name__)
MAX_OBSERVATION_CHARS = 4000  # a tool's text beyond this is cut: observations cost context tokens


class ToolError(UserError):
    """A tool spec or definition that cannot be used; the message names it."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[..., Any]

    def schema(self) -> dict[str, Any]:
        """The OpenAI function format: what templates render and chat requests carry."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def __call__(self, arguments: Union[str, Mapping[str, Any]]) -> str:
        """The observation text for one call; ``arguments`` is the call's JSON object (or its text)."""
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
        except json.JSONDecodeError as exc:
            return f"Error: the arguments of {self.name} are not JSON ({exc}): {str(arguments)[:200]!r}"
        if not isinstance(args, dict):
            return f"Error: the arguments of {self.name} must be a JSON object, got {type(args).__name__}."
        missing = [k for k in self.parameters.get("required", []) if k not in args]
        unknown = sorted(set(args) - set(self.parameters.get("properties", {})))
        if missing or unknown:
            return (f"Error: {self.name} takes {sorted(self.parameters.get('properties', {}))}"
                    + (f"; missing {missing}" if missing else "") + (f"; unknown {unknown}" if unknown else "") + ".")
        try:
            result = self.fn(**args)
        except Exception as exc:  # the tool's own failure is the model's observation
            return f"Error: {type(exc).__name__}: {exc}"
        return _cut(result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str))


def _cut(text: str) -> str:
    return text if len(text) <= MAX_OBSERVATION_CHARS else text[:MAX_OBSERVATION_CHARS] + "\n[output truncated]"


def tool(description: str, parameters: dict[str, Any], name: Optional[str] = None) -> Callable[[Callable], Tool]:
    """Decorator: the function as a Tool named ``name`` (default: the function's own name)."""
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ToolError(f"A tool's parameters must be a JSON schema object ({{'type': 'object', 'properties': "
                        f"{{...}}}}), got {parameters!r}.")

    def wrap(fn: Callable) -> Tool:
        return Tool(name or fn.__name__, description, parameters, fn)
    return wrap


TOOLS: dict[str, Tool] = {}


def register_tool(t: Tool) -> Tool:
    """Make ``t`` available as a built-in by its name; a second tool of that name is a ValueError."""
    if not isinstance(t, Tool):
        raise ValueError(f"register_tool takes a Tool (see @tool), got {type(t).__name__}.")
    if not t.name or ":" in t.name:
        raise ValueError(f"Tool name {t.name!r} must be non-empty and free of ':' (that marks module:attribute).")
    return add_unique(TOOLS, t.name, t, "Tool")


def load_tools(specs: Iterable[str], run_modules: bool = True, sandbox: Optional[str] = None) -> list[Tool]:
    """The tools ``specs`` name (built-in names or ``"module.path:attribute"``), names unique. With
    ``sandbox`` (the config's key: what a run passes) the built-in python tool is checked for it
    (``_python_for``); without, it is the registered one, whose runs are isolated or refused."""
    specs = list(specs)
    found = [resolve_spec(s, TOOLS, "tool", ToolError, "Point the spec at a Tool, made with @tool(description, "
                          "parameters) from stages.rl.agents.tools.", run_modules) for s in specs]
    if not run_modules:
        return [t for t in found if t is not None]
    for spec, t in zip(specs, found):
        if not isinstance(t, Tool):
            raise ToolError(f"Tool {spec!r} is a {type(t).__name__}, not a Tool: wrap the function with "
                            "@tool(description, parameters) from stages.rl.agents.tools so its JSON schema is known.")
    names = [t.name for t in found]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ToolError(f"The tools {specs} give the names {dupes} more than once; a call names its tool, so each "
                        "name must be unique. Rename one of them (@tool(..., name=...)).")
    return [_python_for(sandbox) if t is python and sandbox else t for t in found]


def tools_json(tools: Iterable[Tool]) -> str:
    """The tools as the JSON text templates take (``encode_multiturn(..., tools=...)``)."""
    return json.dumps([t.schema() for t in tools], ensure_ascii=False)


def run_tool_calls(calls: Iterable[FunctionCall], tools: Iterable[Tool]) -> list[str]:
    """Each call's observation, in order; an unknown tool name is an error observation."""
    by_name = {t.name: t for t in tools}
    return [by_name[c.name](c.arguments) if c.name in by_name
            else f"Error: there is no tool {c.name!r}; the tools are {sorted(by_name)}." for c in calls]


def observation_turn(results: list[str]) -> dict[str, str]:
    """The turn that carries a reply's tool results. Several results are one observation turn joined
    by newlines, as ``rayfactory serve`` joins consecutive ``tool`` messages (cluster/serve/protocol.py)."""
    return {"role": "observation", "content": "\n".join(results)}


# --- built-in: calculator ------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100  # 10**100 is fine; 9**9**9 would take the process down
MAX_RESULT_DIGITS = 1000


def evaluate(expression: str) -> Union[int, float]:
    """Arithmetic on numbers with + - * / // % ** and parentheses, parsed with ast (never eval)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> Union[int, float]:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponents above {MAX_EXPONENT} are not allowed")
        if isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, int) and \
                math.log10(abs(left) + 1) + math.log10(abs(right) + 1) > MAX_RESULT_DIGITS:
            raise ValueError(f"results above {MAX_RESULT_DIGITS} digits are not allowed")
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex):
            raise ValueError("the result is not a real number")
        if isinstance(result, int) and result.bit_length() > MAX_RESULT_DIGITS * 3.33:
            raise ValueError(f"results above {MAX_RESULT_DIGITS} digits are not allowed")
        return result
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {ast.dump(node)[:60]}")


# The schema lives with the demo data (registries/synthetic/calculator.py), whose sft warm start
# must show the policy exactly the system prompt the RL loop renders.
@tool(CALCULATOR["description"], CALCULATOR["parameters"], name=CALCULATOR["name"])
def calculator(expression: str) -> str:
    value = evaluate(expression)
    return str(int(value)) if isinstance(value, float) and value.is_integer() and abs(value) < 1e15 else str(value)


# --- built-in: python ------------------------------------------------------------------------------

PYTHON_TOOL_LIMITS = SandboxLimits()
PYTHON_DESCRIPTION = ("Run a Python program in a sandbox (no network, no files but its own working directory, "
                      "a few seconds of CPU) and return what it prints.")
PYTHON_PARAMETERS = {"type": "object", "properties": {"code": {"type": "string", "description": "a whole Python "
                                                               "program; print the values you need"}},
                     "required": ["code"]}


def python_tool(sandbox: str = "isolated") -> Tool:
    """The python tool, running each program ``sandbox`` (stages/rl/agents/sandbox.py): "isolated", or
    refused where that cannot be enforced; "unisolated" only as the config's explicit opt-in."""
    def python(code: str) -> str:
        result = run_python(code, PYTHON_TOOL_LIMITS, sandbox)
        text = result.stdout
        if result.exit_code != 0 or result.limit:
            text += result.stderr[-1000:]  # the traceback's end is what explains the failure
        if result.stopped:  # kept whole: the observation's cap (MAX_OBSERVATION_CHARS) cuts the text before it
            text = text[:MAX_OBSERVATION_CHARS - len(result.stopped) - 1] + "\n" + result.stopped
        return text if text.strip() else "(no output)"
    return Tool("python", PYTHON_DESCRIPTION, PYTHON_PARAMETERS, python)


python = python_tool()


def _python_for(sandbox: str) -> Tool:
    """The python tool for a config's ``sandbox``: isolated only where a test run proves the
    isolation holds (else a ToolError naming the missing piece and the opt-in); unisolated, warned."""
    if sandbox == "unisolated":
        logger.warning("sandbox: unisolated: the python tool runs the policy's programs WITHOUT isolation: they can "
                       "read and write whatever this process can (only time, output and rlimits are limited).")
        return python_tool("unisolated")
    try:
        check_isolation()
    except SandboxUnavailable as exc:
        raise ToolError(f"Tool 'python': {exc}") from None
    return python


for _t in (calculator, python):
    register_tool(_t)
