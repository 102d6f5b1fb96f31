"""Stand-ins for LLaMA-Factory's demo datasets, under their names, made from our synthetic tasks.

LLaMA-Factory's README and ``examples/`` YAMLs name ``alpaca_en_demo``, ``glaive_toolcall_en_demo``,
``dpo_en_demo``, ``kto_en_demo``, ``c4_demo`` and ``mllm_demo``. With entries of those names in
data/dataset_info.json, in the formats and columns LLaMA-Factory's entries declare, those commands
run here unchanged (with a ``tiny:`` model). The rows are ours: the checkable tasks of tasks.py
(training prompts only, so the ``*_eval`` sets stay held out) and the shapes pictures (shapes.py);
none of LLaMA-Factory's text is copied.

| name | LLaMA-Factory's format | rows here |
| --- | --- | --- |
| alpaca_en_demo | alpaca: instruction, input, output | 200: addition, reversal, copying |
| glaive_toolcall_en_demo | sharegpt, ``conversations`` + ``tools`` (a JSON string) | 100: add / reverse_word calls, some plain answers |
| dpo_en_demo | sharegpt ranking: ``conversations`` ending on the prompt, ``chosen`` / ``rejected`` messages | 200: right answer vs a near miss |
| kto_en_demo | sharegpt, role/content ``messages``, ``kto_tag`` in column ``label`` | 200: right (true) or near miss (false) |
| c4_demo | jsonl ``{"text": ...}`` documents, ``prompt: text`` | 100 documents of 4-8 sentences |
| mllm_demo | sharegpt, role/content ``messages`` with ``<image>``, ``images`` | 96: one per shapes_train picture, half two-turn |
"""

from __future__ import annotations

import random
from typing import Any, Iterator

from . import shapes
from .tasks import ADDITION, COPYING, REVERSAL, SyntheticTask

ROLE_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
# The dataset_info.json entries, as LLaMA-Factory declares these names (file_name aside, which add() sets).
ENTRIES: dict[str, dict[str, Any]] = {
    "alpaca_en_demo": {},
    "glaive_toolcall_en_demo": {"formatting": "sharegpt", "columns": {"messages": "conversations", "tools": "tools"}},
    "mllm_demo": {"formatting": "sharegpt", "columns": {"messages": "messages", "images": "images"},
                  "tags": dict(ROLE_TAGS)},
    "dpo_en_demo": {"ranking": True, "formatting": "sharegpt",
                    "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
    "kto_en_demo": {"formatting": "sharegpt", "columns": {"messages": "messages", "kto_tag": "label"},
                    "tags": dict(ROLE_TAGS)},
    "c4_demo": {"columns": {"prompt": "text"}},
}
FILE_NAMES = {"c4_demo": "c4_demo.jsonl"}  # the others: <name>.json
ROWS = 200
TOOL_ROWS = 100  # each row repeats the tools' JSON schema: ~1 kB a row
C4_DOCUMENTS = 100
TASK_WEIGHTS = {"addition": 2, "reversal": 1, "copying": 1}
TASKS_BY_NAME: dict[str, SyntheticTask] = {"addition": ADDITION, "reversal": REVERSAL, "copying": COPYING}


def lf_demo_datasets(train: dict[str, list[str]], tool_rows, sentences: list[str], seed: int
                     ) -> Iterator[tuple[str, str, dict, list[dict]]]:
    """(name, file_name, dataset_info entry without file_name, rows) of each stand-in. ``train``:
    each task's training prompts; ``tool_rows(n, rng)``: the tool_calls rows' builder (generate.py);
    ``sentences``: the pretraining sentences (generate.py)."""
    makers = {
        "alpaca_en_demo": lambda rng: _alpaca(train, rng),
        "glaive_toolcall_en_demo": lambda rng: tool_rows(TOOL_ROWS, rng),
        "mllm_demo": _mllm,
        "dpo_en_demo": lambda rng: _pairs(train, rng),
        "kto_en_demo": lambda rng: _kto(train, rng),
        "c4_demo": lambda rng: _documents(sentences, rng),
    }
    for name, entry in ENTRIES.items():
        rows = makers[name](random.Random(f"{seed}:{name}"))  # a stream per dataset: each stays as it is
        yield name, FILE_NAMES.get(name, f"{name}.json"), entry, rows


def _prompt(train: dict[str, list[str]], rng: random.Random) -> tuple[SyntheticTask, str]:
    name = rng.choices(list(TASK_WEIGHTS), weights=list(TASK_WEIGHTS.values()))[0]
    return TASKS_BY_NAME[name], rng.choice(train[name])


def _alpaca(train, rng) -> list[dict]:
    rows = []
    for _ in range(ROWS):
        task, prompt = _prompt(train, rng)
        rows.append({"instruction": prompt, "input": "", "output": task.solve(prompt)})
    return rows


def _pairs(train, rng) -> list[dict]:
    rows = []
    for _ in range(ROWS):
        task, prompt = _prompt(train, rng)
        rows.append({"conversations": [{"from": "human", "value": prompt}],
                     "chosen": {"from": "gpt", "value": task.solve(prompt)},
                     "rejected": {"from": "gpt", "value": task.wrong(prompt, rng)}})
    return rows


def _kto(train, rng) -> list[dict]:
    rows = []
    for _ in range(ROWS):
        task, prompt = _prompt(train, rng)
        good = rng.random() < 0.5
        answer = task.solve(prompt) if good else task.wrong(prompt, rng)
        rows.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
                     "label": good})
    return rows


def _documents(sentences: list[str], rng: random.Random) -> list[dict]:
    return [{"text": " ".join(rng.sample(sentences, rng.randint(4, 8)))} for _ in range(C4_DOCUMENTS)]


def _mllm(rng) -> list[dict]:
    """A conversation about each shapes_train picture (committed under data/shapes/): its colour or
    shape asked first, the other one next in half of them."""
    pictures = shapes.plan("shapes_train", shapes.SPLITS["shapes_train"])
    rows = []
    for picture in pictures:
        kinds = ["colour", "shape"]
        rng.shuffle(kinds)
        answers = {"colour": picture.colour, "shape": picture.shape}
        messages = [{"role": "user", "content": shapes.QUESTIONS[kinds[0]]},
                    {"role": "assistant", "content": answers[kinds[0]]}]
        if rng.random() < 0.5:
            follow_up = "And its colour?" if kinds[1] == "colour" else "And what shape is it?"
            messages += [{"role": "user", "content": follow_up}, {"role": "assistant", "content": answers[kinds[1]]}]
        rows.append({"messages": messages, "images": [picture.file_name]})
    return rows
