"""Build RayFactory's demo datasets from the synthetic tasks, deterministically.

``build()`` returns every file as text plus its dataset_info.json entry; ``write()`` puts them in
a folder and merges the entries into that folder's dataset_info.json (entries it does not own
are kept). Same seed, same bytes: a test regenerates the committed files and compares.

Held-out eval sets are separate datasets (``*_eval``) drawn from prompts that no training
file contains. Related tasks share one split (addition and tool_add split the same number
pairs; reversal and tool_reverse the same words), so the tool eval set is held out too.
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
from dataclasses import dataclass
from typing import Any

from .calculator import calculator_datasets
from .eval_tasks import eval_task_files
from .identity import IDENTITY_PAIRS, filled
from .lf_demos import lf_demo_datasets
from .tasks import ADDITION, COPYING, REVERSAL, TOOL_ADD, TOOL_REVERSE, SyntheticTask
from .words import WORDS

SEED = 20250601
EVAL_TASKS_DIR = os.path.join("eval_tasks", "rayfactory")  # our lm-evaluation-harness tasks' data, under data/
EVAL_FRACTION = 0.2
SYSTEM_PROMPT = "You are a careful assistant. Reply with the answer only."
TOOLS = [
    {
        "name": "add",
        "description": "Add two integers and return their sum.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "description": "The first number."},
                "b": {"type": "integer", "description": "The second number."},
            },
            "required": ["a", "b"],
        },
    },
    {
        "name": "reverse_word",
        "description": "Return a word spelled backwards.",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string", "description": "The word to reverse."}},
            "required": ["word"],
        },
    },
]


@dataclass(frozen=True)
class DemoFile:
    name: str  # dataset name in dataset_info.json
    file_name: str
    entry: dict[str, Any]
    text: str


def split_prompts(task: SyntheticTask, group: str, seed: int = SEED) -> tuple[list[str], list[str]]:
    """(train, eval) prompts of a task; tasks in the same ``group`` have parallel pools and split alike."""
    pool = task.pool()
    order = list(range(len(pool)))
    random.Random(f"{seed}:{group}").shuffle(order)  # str seeds are hashed stably (not PYTHONHASHSEED)
    n_eval = round(len(pool) * EVAL_FRACTION)
    return [pool[i] for i in sorted(order[n_eval:])], [pool[i] for i in sorted(order[:n_eval])]


def build(seed: int = SEED) -> list[DemoFile]:
    groups = (
        (ADDITION, "addition"), (TOOL_ADD, "addition"),
        (REVERSAL, "words"), (TOOL_REVERSE, "words"),
        (COPYING, "copying"),
    )
    splits = {task.name: split_prompts(task, group, seed) for task, group in groups}
    train = {name: s[0] for name, s in splits.items()}
    held_out = {name: s[1] for name, s in splits.items()}
    files: list[DemoFile] = []

    def add(name: str, file_name: str, entry: dict, text: str) -> None:
        files.append(DemoFile(name, file_name, {"file_name": file_name, **entry}, text))

    add("identity", "identity.json", {}, _json([{"instruction": q, "output": a} for q, a in IDENTITY_PAIRS]))
    add("identity_demo", "identity_demo.json", {},
        _json([{"instruction": filled(q), "output": filled(a)} for q, a in IDENTITY_PAIRS]))
    for split, prompts in (("train", train), ("eval", held_out)):
        add(f"arith_{split}", f"arith_{split}.json", {}, _json(_alpaca(ADDITION, prompts["addition"])))
        add(f"reverse_{split}", f"reverse_{split}.jsonl", {}, _jsonl(_alpaca(REVERSAL, prompts["reversal"])))
        copies = _alpaca(COPYING, prompts["copying"])
        add(f"copy_{split}", f"copy_{split}.csv", {}, _csv(copies, ["instruction", "output"]))

    rng = random.Random(f"{seed}:conversations")
    sharegpt = {"formatting": "sharegpt", "columns": {"messages": "conversations", "system": "system"}}
    for split, prompts, n in (("", train, 400), ("_eval", held_out, 100)):
        multi_turn = 0.25 if not split else 0.0
        rows = _sharegpt_tasks(prompts, n, multi_turn, rng)
        add(f"tasks_sharegpt{split}", f"tasks_sharegpt{split}.json", sharegpt, _json(rows))
        rows = _openai_tasks(prompts, n, multi_turn, rng)
        add(f"tasks_openai{split}", f"tasks_openai{split}.jsonl", {"formatting": "openai"}, _jsonl(rows))

    rng = random.Random(f"{seed}:preferences")
    ranking = {"ranking": True, "columns": {"prompt": "instruction", "chosen": "chosen", "rejected": "rejected"}}
    add("arith_pref", "arith_pref.json", ranking, _json(_alpaca_pairs(train["addition"], rng)))
    add("arith_pref_eval", "arith_pref_eval.json", ranking, _json(_alpaca_pairs(held_out["addition"], rng)))
    sharegpt_ranking = {
        "formatting": "sharegpt",
        "ranking": True,
        "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
    }
    rows = _sharegpt_pairs(train["addition"], rng)
    add("arith_pref_sharegpt", "arith_pref_sharegpt.json", sharegpt_ranking, _json(rows))
    kto = {"formatting": "sharegpt", "columns": {"messages": "conversations", "kto_tag": "kto_tag"}}
    add("arith_kto", "arith_kto.json", kto, _json(_kto(train["addition"], rng)))
    add("arith_kto_eval", "arith_kto_eval.json", kto, _json(_kto(held_out["addition"], rng)))

    pretrain = {"columns": {"prompt": "text"}}
    add("pretrain_txt", "pretrain.txt", pretrain, _pretrain_lines(train))
    add("pretrain_jsonl", "pretrain.jsonl", pretrain, _jsonl(_pretrain_docs(train, random.Random(f"{seed}:pretrain"))))

    rng = random.Random(f"{seed}:tools")
    tools = {"formatting": "sharegpt", "columns": {"messages": "conversations", "tools": "tools"}}
    add("tool_calls", "tool_calls.json", tools, _json(_tool_rows(train, 300, rng)))
    add("tool_calls_eval", "tool_calls_eval.json", tools, _json(_tool_rows(held_out, 60, rng)))

    for name, entry, rows in calculator_datasets(seed):  # multi-turn RL with a calculator tool
        add(name, f"{name}.json", entry, _json(rows))

    # Stage ppo's demo preference (sft -> rm -> ppo): a number answers an addition question, a word
    # does not. A reward model learns it in ~150 steps; a policy that still answers with anything
    # but a number has room to climb.
    rng = random.Random(f"{seed}:format_preferences")
    add("arith_format_pref", "arith_format_pref.json", ranking, _json(_format_pairs(train["addition"], rng)))
    add("arith_format_pref_eval", "arith_format_pref_eval.json", ranking,
        _json(_format_pairs(held_out["addition"], rng)))

    # LLaMA-Factory's demo names (alpaca_en_demo, dpo_en_demo, ...) in its formats, so its README's
    # and examples' commands run here as written: lf_demos.py.
    for name, file_name, entry, rows in lf_demo_datasets(train, _tool_rows_of(train), _sentences(train), seed):
        add(name, file_name, entry, _jsonl(rows) if file_name.endswith(".jsonl") else _json(rows))
    return files


def build_eval_tasks(seed: int = SEED) -> dict[str, str]:
    """Path under the data folder -> text, for the harness tasks' data (registries/synthetic/eval_tasks.py)."""
    train, held_out = split_prompts(ADDITION, "addition", seed)
    return {os.path.join(EVAL_TASKS_DIR, name): text for name, text in eval_task_files(train, held_out, seed).items()}


def _tool_rows_of(train: dict[str, list[str]]):
    return lambda n, rng: _tool_rows(train, n, rng)


def write(out_dir: str, seed: int = SEED) -> list[str]:
    """Write the demo files and merge their entries into ``out_dir/dataset_info.json``."""
    os.makedirs(out_dir, exist_ok=True)
    files = build(seed)
    for f in files:
        with open(os.path.join(out_dir, f.file_name), "w", encoding="utf-8", newline="") as fh:
            fh.write(f.text)
    eval_tasks = build_eval_tasks(seed)
    for name, text in eval_tasks.items():
        os.makedirs(os.path.dirname(os.path.join(out_dir, name)), exist_ok=True)
        with open(os.path.join(out_dir, name), "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
    info_path = os.path.join(out_dir, "dataset_info.json")
    info: dict[str, Any] = {}
    if os.path.isfile(info_path):
        with open(info_path, encoding="utf-8") as fh:
            info = json.load(fh)
    for f in files:
        info[f.name] = f.entry
    with open(info_path, "w", encoding="utf-8", newline="") as fh:
        fh.write(_json(info))
    return [f.file_name for f in files] + list(eval_tasks) + ["dataset_info.json"]


# ---------------------------------------------------------------------- row builders
def _alpaca(task: SyntheticTask, prompts: list[str]) -> list[dict]:
    return [{"instruction": p, "output": task.solve(p)} for p in prompts]


def _solve(prompt: str) -> str:
    for task in (ADDITION, REVERSAL, COPYING):
        if task.pattern.fullmatch(prompt):
            return task.solve(prompt)
    raise AssertionError(prompt)


def _pick_prompt(prompts: dict[str, list[str]], rng: random.Random) -> str:
    task = rng.choices(["addition", "reversal", "copying"], weights=[2, 1, 1])[0]
    return rng.choice(prompts[task])


def _task_turns(prompts: dict[str, list[str]], multi_turn: float, rng: random.Random) -> list[tuple[str, str]]:
    n_turns = 2 if rng.random() < multi_turn else 1
    return [(p, _solve(p)) for p in (_pick_prompt(prompts, rng) for _ in range(n_turns))]


def _sharegpt_tasks(prompts, n, multi_turn, rng) -> list[dict]:
    rows = []
    for _ in range(n):
        row: dict[str, Any] = {"conversations": []}
        for q, a in _task_turns(prompts, multi_turn, rng):
            row["conversations"] += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
        if rng.random() < 0.3:
            row["system"] = SYSTEM_PROMPT
        rows.append(row)
    return rows


def _openai_tasks(prompts, n, multi_turn, rng) -> list[dict]:
    rows = []
    for _ in range(n):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.3 else []
        for q, a in _task_turns(prompts, multi_turn, rng):
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        rows.append({"messages": messages})
    return rows


def _alpaca_pairs(prompts: list[str], rng: random.Random) -> list[dict]:
    return [{"instruction": p, "chosen": ADDITION.solve(p), "rejected": ADDITION.wrong(p, rng)} for p in prompts]


def _format_pairs(prompts: list[str], rng: random.Random) -> list[dict]:
    return [{"instruction": p, "chosen": ADDITION.solve(p), "rejected": rng.choice(WORDS)} for p in prompts]


def _sharegpt_pairs(prompts: list[str], rng: random.Random) -> list[dict]:
    return [
        {
            "conversations": [{"from": "human", "value": p}],
            "chosen": {"from": "gpt", "value": ADDITION.solve(p)},
            "rejected": {"from": "gpt", "value": ADDITION.wrong(p, rng)},
        }
        for p in prompts
    ]


def _kto(prompts: list[str], rng: random.Random) -> list[dict]:
    rows = []
    for p in prompts:  # every prompt once with the right answer (true) and once with a wrong one (false)
        for answer, tag in ((ADDITION.solve(p), True), (ADDITION.wrong(p, rng), False)):
            conversation = [{"from": "human", "value": p}, {"from": "gpt", "value": answer}]
            rows.append({"conversations": conversation, "kto_tag": tag})
    return rows


def _sentences(train: dict[str, list[str]]) -> list[str]:
    sums = [f"{m[1]} plus {m[2]} equals {int(m[1]) + int(m[2])}." for m in map(ADDITION.match, train["addition"])]
    words = [f"The word {m[1]} backwards is {m[1][::-1]}." for m in map(REVERSAL.match, train["reversal"])]
    return sums + words


def _pretrain_lines(train: dict[str, list[str]]) -> str:
    return "".join(s + "\n" for s in _sentences(train))


def _pretrain_docs(train: dict[str, list[str]], rng: random.Random) -> list[dict]:
    sentences = _sentences(train)
    return [{"text": " ".join(rng.sample(sentences, rng.randint(3, 5)))} for _ in range(200)]


def _tool_rows(prompts: dict[str, list[str]], n: int, rng: random.Random) -> list[dict]:
    rows = []
    for _ in range(n):
        kind = rng.choices(["tool_add", "tool_reverse", "plain"], weights=[2, 2, 1])[0]
        if kind == "plain":  # tools on offer but not needed: the model should just answer
            p = rng.choice(prompts["addition"])
            turns = [("human", p), ("gpt", ADDITION.solve(p))]
        else:
            task = TOOL_ADD if kind == "tool_add" else TOOL_REVERSE
            p = rng.choice(prompts[kind])
            call = json.loads(task.solve(p))
            args = call["arguments"]
            result = args["a"] + args["b"] if kind == "tool_add" else args["word"][::-1]
            turns = [
                ("human", p),
                ("function_call", task.solve(p)),
                ("observation", json.dumps({"result": result})),
                ("gpt", str(result)),
            ]
        rows.append({"conversations": [{"from": r, "value": v} for r, v in turns], "tools": json.dumps(TOOLS)})
    return rows


# ---------------------------------------------------------------------- serialisation
def _json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def _csv(rows: list[dict], columns: list[str]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()
