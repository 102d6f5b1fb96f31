"""Checkable synthetic tasks: a fixed prompt wording, a solver, and an exact-match checker.

A checker needs only the prompt and the model's reply: the solver recomputes the answer from
the prompt, so a tiny model's held-out accuracy can be measured on any prompt of the task,
not just on stored pairs. One ``register_task`` call per task.

Each task also enumerates its whole pool of distinct prompts in a fixed order, which the
generator splits into train and held-out eval prompts that never overlap.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from ..unique import add_unique
from .words import WORDS


@dataclass(frozen=True)
class SyntheticTask:
    name: str
    description: str
    pattern: re.Pattern  # a prompt of this task, with its inputs as groups
    solve_match: Callable[[re.Match], str]
    pool: Callable[[], list[str]]  # every distinct prompt, in a fixed order
    wrong_match: Callable[[re.Match, random.Random], str]  # a near-miss answer, never the right one
    compare: Callable[[str, str], bool] = lambda expected, reply: reply.strip() == expected

    def match(self, prompt: str) -> re.Match:
        m = self.pattern.fullmatch(prompt.strip())
        if m is None:
            raise ValueError(f"Prompt {prompt!r} is not a {self.name!r} prompt (expected {self.pattern.pattern}).")
        return m

    def solve(self, prompt: str) -> str:
        return self.solve_match(self.match(prompt))

    def wrong(self, prompt: str, rng: random.Random) -> str:
        answer = self.wrong_match(self.match(prompt), rng)
        assert answer != self.solve(prompt), (self.name, prompt)
        return answer

    def check(self, prompt: str, reply: str) -> bool:
        """Exact match of the reply (surrounding whitespace ignored) with the solved answer."""
        return self.compare(self.solve(prompt), reply)


TASKS: dict[str, SyntheticTask] = {}


def register_task(task: SyntheticTask) -> SyntheticTask:
    return add_unique(TASKS, task.name, task, "Synthetic task")


def get_task(name: str) -> SyntheticTask:
    if name not in TASKS:
        raise ValueError(f"Unknown synthetic task {name!r}; known: {', '.join(TASKS)}.")
    return TASKS[name]


def task_for_prompt(prompt: str) -> SyntheticTask:
    for task in TASKS.values():
        if task.pattern.fullmatch(prompt.strip()):
            return task
    raise ValueError(f"No synthetic task matches the prompt {prompt!r}.")


def check_answer(prompt: str, reply: str) -> bool:
    return task_for_prompt(prompt).check(prompt, reply)


def exact_match_accuracy(prompts: Sequence[str], replies: Sequence[str]) -> float:
    if len(prompts) != len(replies):
        raise ValueError(f"{len(prompts)} prompts but {len(replies)} replies.")
    if not prompts:
        return 0.0
    return sum(check_answer(p, r) for p, r in zip(prompts, replies)) / len(prompts)


# ---------------------------------------------------------------------- addition
MAX_ADDEND = 20  # operands 0..19: sums stay two digits and a tiny model learns it in minutes


def _add_wrong(m: re.Match, rng: random.Random) -> str:
    total = int(m[1]) + int(m[2])
    return str(max(0, total + rng.choice([-2, -1, 1, 2])) if total >= 2 else total + rng.choice([1, 2]))


ADDITION = register_task(
    SyntheticTask(
        name="addition",
        description="Add two numbers below 20: 'What is 12+7?' -> '19'.",
        pattern=re.compile(r"What is (\d+)\+(\d+)\?"),
        solve_match=lambda m: str(int(m[1]) + int(m[2])),
        pool=lambda: [f"What is {a}+{b}?" for a in range(MAX_ADDEND) for b in range(MAX_ADDEND)],
        wrong_match=_add_wrong,
    )
)


# ---------------------------------------------------------------------- word reversal
def _reverse_wrong(m: re.Match, rng: random.Random) -> str:
    word = m[1][::-1]
    i = rng.randrange(len(word) - 1)
    swapped = word[:i] + word[i + 1] + word[i] + word[i + 2 :]
    return swapped if swapped != word else word + word[-1]  # a doubled letter when the swap changes nothing


REVERSAL = register_task(
    SyntheticTask(
        name="reversal",
        description="Spell a word backwards: 'Reverse the word: lamp' -> 'pmal'.",
        pattern=re.compile(r"Reverse the word: ([a-z]+)"),
        solve_match=lambda m: m[1][::-1],
        pool=lambda: [f"Reverse the word: {w}" for w in WORDS],
        wrong_match=_reverse_wrong,
    )
)


# ---------------------------------------------------------------------- copying
def _copy_pool() -> list[str]:
    # Every ordered pair of distinct words would be ~15k prompts; a fixed seeded sample is plenty.
    rng = random.Random(1234)
    pairs = list(itertools.permutations(WORDS, 2))
    rng.shuffle(pairs)
    triples = [(a, b, WORDS[(WORDS.index(a) * 7 + WORDS.index(b)) % len(WORDS)]) for a, b in pairs[:300]]
    return [f"Copy: {a} {b}" for a, b in pairs[300:600]] + [f"Copy: {' '.join(t)}" for t in triples]


def _copy_wrong(m: re.Match, rng: random.Random) -> str:
    words = m[1].split()
    return " ".join(words[:-1]) if rng.random() < 0.5 else " ".join(words[1:] + words[:1])


COPYING = register_task(
    SyntheticTask(
        name="copying",
        description="Repeat the words exactly: 'Copy: red fox' -> 'red fox'.",
        pattern=re.compile(r"Copy: ((?:[a-z]+ )*[a-z]+)"),
        solve_match=lambda m: m[1],
        pool=_copy_pool,
        wrong_match=_copy_wrong,
    )
)


# ---------------------------------------------------------------------- tool calls
def _same_call(expected: str, reply: str) -> bool:
    """A function-call reply matches when its JSON equals the expected call (key order aside)."""
    try:
        got = json.loads(reply)
    except json.JSONDecodeError:
        return False
    got = got[0] if isinstance(got, list) and len(got) == 1 else got
    return got == json.loads(expected)


def _call(name: str, **arguments) -> str:
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


TOOL_ADD = register_task(
    SyntheticTask(
        name="tool_add",
        description="Call the add tool: 'Use a tool to add 12 and 7.' -> add(a=12, b=7).",
        pattern=re.compile(r"Use a tool to add (\d+) and (\d+)\."),
        solve_match=lambda m: _call("add", a=int(m[1]), b=int(m[2])),
        pool=lambda: [f"Use a tool to add {a} and {b}." for a in range(MAX_ADDEND) for b in range(MAX_ADDEND)],
        wrong_match=lambda m, rng: _call("add", a=int(m[2]) + 1, b=int(m[1])),
        compare=_same_call,
    )
)

TOOL_REVERSE = register_task(
    SyntheticTask(
        name="tool_reverse",
        description="Call the reverse_word tool: 'Use a tool to reverse the word lamp.' -> reverse_word(word='lamp').",
        pattern=re.compile(r"Use a tool to reverse the word ([a-z]+)\."),
        solve_match=lambda m: _call("reverse_word", word=m[1]),
        pool=lambda: [f"Use a tool to reverse the word {w}." for w in WORDS],
        wrong_match=lambda m, rng: _call("reverse_word", word=m[1][::-1]),
        compare=_same_call,
    )
)
