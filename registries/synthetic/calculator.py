"""Multi-digit arithmetic with a calculator tool: the demo data of multi-turn RL (stage grpo with
``tools: [calculator]``).

A model this size gets "What is 347*28?" wrong on its own; with the calculator it only has to
write the call and copy the result. Three datasets, drawn from disjoint problems:

* ``calc_tool_sft``: demonstrations for a short sft warm start (sharegpt with a tools column):
  the question, the call ``{"name": "calculator", "arguments": {"expression": "347*28"}}``, the
  tool's result as the observation, the result as the answer;
* ``calc_prompts`` / ``calc_eval``: questions with their answers (alpaca), the prompts RL trains on
  and the held-out ones its greedy evaluation scores.

``CALCULATOR`` is the tool's schema as the RL loop renders it (stages/rl/agents/tools.py builds its
built-in calculator from it), so the warm start sees exactly the system prompt RL shows.
"""

from __future__ import annotations

import json
import random
from typing import Any

CALCULATOR: dict[str, Any] = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses) and return its value.",
    "parameters": {"type": "object",
                   "properties": {"expression": {"type": "string", "description": "e.g. 123 * (45 + 6)"}},
                   "required": ["expression"]},
}
TOOLS_TEXT = json.dumps([{"type": "function", "function": CALCULATOR}], ensure_ascii=False)
OPERATORS = ("+", "-", "*")


def problems(seed: str, count: int) -> list[tuple[str, int]]:
    """``count`` distinct (expression, value) pairs: two- and three-digit operands, + - *."""
    rng = random.Random(seed)
    seen: dict[str, int] = {}
    while len(seen) < count:
        a, b = rng.randint(10, 999), rng.randint(10, 99)
        op = rng.choice(OPERATORS)
        expression = f"{a}{op}{b}"
        seen.setdefault(expression, a + b if op == "+" else a - b if op == "-" else a * b)
    return list(seen.items())


def question(expression: str) -> str:
    return f"What is {expression}?"


def demonstrations(pairs: list[tuple[str, int]]) -> list[dict]:
    """sharegpt rows: question, calculator call, its result, the answer."""
    rows = []
    for expression, value in pairs:
        call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        turns = [("human", question(expression)), ("function_call", call), ("observation", str(value)),
                 ("gpt", str(value))]
        rows.append({"conversations": [{"from": r, "value": v} for r, v in turns], "tools": TOOLS_TEXT})
    return rows


def prompts(pairs: list[tuple[str, int]]) -> list[dict]:
    """alpaca rows: the question and its answer (the reference exact_match compares with)."""
    return [{"instruction": question(expression), "output": str(value)} for expression, value in pairs]


def calculator_datasets(seed: int) -> list[tuple[str, dict, list[dict]]]:
    """(name, dataset_info entry, rows) of the three datasets."""
    pairs = problems(f"{seed}:calculator", 1100)
    sft, rl, held_out = pairs[:500], pairs[500:1000], pairs[1000:]
    tools = {"formatting": "sharegpt", "columns": {"messages": "conversations", "tools": "tools"}}
    return [("calc_tool_sft", tools, demonstrations(sft)), ("calc_prompts", {}, prompts(rl)),
            ("calc_eval", {}, prompts(held_out))]
