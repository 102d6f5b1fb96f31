"""``rayfactory eval``: lm-evaluation-harness tasks on our models, checked against the harness's own
``hf`` model (the harness run as its users run it) on the same weights, sample by sample.

The tiny random model answers nothing right, which suits a parity test: every log-likelihood and
every greedy reply must come out the same, whatever they are. RayFactory's shipped tasks
(data/eval_tasks) keep it offline; a few questions each keep it to seconds.
"""

from __future__ import annotations

import json
import math

import pytest

from cluster.cli import main as cli_main
from stages.inference.eval_args import EvaluationArguments
from tests.inference.conftest import BASE, TEMPLATE

LIMIT = 12  # questions per task
TOL = 1e-4  # log-likelihood sums of a float32 model, batched differently on the two sides


def _theirs(pretrained: str, tasks: list[str], n_shot: int) -> dict:
    """The harness's own transformers model, as `lm_eval --model hf --include_path data/eval_tasks` runs it."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from stages.inference.evaluation import SHIPPED_TASKS

    return simple_evaluate(model="hf", model_args={"pretrained": pretrained, "dtype": "float32", "device": "cpu"}, tasks=tasks,
                           num_fewshot=n_shot, batch_size=1, limit=LIMIT, task_manager=TaskManager(include_path=SHIPPED_TASKS),
                           log_samples=True)


def _ours(config: dict, **evaluation) -> dict:
    from cluster.config import load_config
    from stages.inference.evaluation import evaluate

    cfg = load_config({**config, "eval_limit": LIMIT, **evaluation}, purpose="infer")
    return evaluate(cfg.inference_spec(), cfg.evaluation)


def _by_doc(results: dict, task: str) -> dict[int, list]:
    return {row["doc_id"]: row["resps"] for row in results["samples"][task]}


@pytest.fixture(scope="module")
def merged_adapter(adapter_outputs, tmp_path_factory):
    """The "math" adapter merged into the base and saved: what the harness's hf model can load."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.loading import resolve_model_path

    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(BASE), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_outputs["math"]).merge_and_unload()
    folder = tmp_path_factory.mktemp("merged")
    merged.save_pretrained(folder)
    AutoTokenizer.from_pretrained(adapter_outputs["math"]).save_pretrained(folder)
    return str(folder)


def test_an_adapter_scores_unmerged_as_the_harness_scores_the_merged_model(adapter_outputs, merged_adapter):
    """Multiple choice (log-likelihoods, 2-shot), exact-match generation (greedy replies) and perplexity
    (rolling log-likelihoods): the same numbers per question, so the same scores. Unmerged on our side:
    the adapter is applied by PEFT."""
    tasks = ["rf_arith_mc", "rf_arith_gen", "rf_arith_text"]
    theirs = _theirs(merged_adapter, tasks, n_shot=2)
    ours = _ours({"model_name_or_path": BASE, "adapter_name_or_path": adapter_outputs["math"], "template": TEMPLATE},
                 task=",".join(tasks), n_shot=2, batch_size=3)

    choices_ours, choices_theirs = _by_doc(ours, "rf_arith_mc"), _by_doc(theirs, "rf_arith_mc")
    assert sorted(choices_ours) == sorted(choices_theirs) == list(range(LIMIT))
    for doc, responses in choices_theirs.items():
        for (ll_ours, greedy_ours), (ll_theirs, greedy_theirs) in zip(
            [r[0] for r in choices_ours[doc]], [r[0] for r in responses]
        ):
            assert math.isclose(ll_ours, ll_theirs, abs_tol=TOL), (doc, ll_ours, ll_theirs)
            assert greedy_ours == greedy_theirs
    assert ours["results"]["rf_arith_mc"]["acc,none"] == theirs["results"]["rf_arith_mc"]["acc,none"]

    replies_ours, replies_theirs = _by_doc(ours, "rf_arith_gen"), _by_doc(theirs, "rf_arith_gen")
    assert replies_ours == replies_theirs
    assert any(text.strip() for reply in replies_ours.values() for text in reply[0]), "every reply was empty"
    for reading in ("exact", "last_number"):  # the task's two filters
        key = f"exact_match,{reading}"
        assert ours["results"]["rf_arith_gen"][key] == theirs["results"]["rf_arith_gen"][key]

    texts_ours, texts_theirs = _by_doc(ours, "rf_arith_text"), _by_doc(theirs, "rf_arith_text")
    assert sorted(texts_ours) == sorted(texts_theirs) == list(range(LIMIT))
    for doc, responses in texts_theirs.items():
        assert math.isclose(texts_ours[doc][0][0], responses[0][0], abs_tol=TOL), (doc, texts_ours[doc], responses)
    assert math.isclose(ours["results"]["rf_arith_text"]["word_perplexity,none"],
                        theirs["results"]["rf_arith_text"]["word_perplexity,none"], rel_tol=1e-5)


def test_the_adapter_is_not_ignored(adapter_outputs):
    """The parity above would also hold if our side ignored adapters and the merge did nothing: the
    bare base must score differently."""
    bare = _ours({"model_name_or_path": BASE, "template": TEMPLATE}, task="rf_arith_mc", n_shot=0, eval_limit=1)
    adapted = _ours({"model_name_or_path": BASE, "adapter_name_or_path": adapter_outputs["math"], "template": TEMPLATE},
                    task="rf_arith_mc", n_shot=0, eval_limit=1)
    first = lambda results: _by_doc(results, "rf_arith_mc")[0][0][0][0]  # noqa: E731 (doc 0, choice 0's log-likelihood)
    assert abs(first(bare) - first(adapted)) > 1e-3


def test_chat_prompts_are_the_templates_token_ids(base_model_path):
    """With apply_chat_template the harness gets text back, but the scored ids are the ones our
    template renders (the tokenizer's Jinja template is not used), and the reply is encoded after them."""
    from cluster.config import load_config
    from stages.inference.chat_model import ChatModel
    from stages.inference.harness_model import HarnessModel

    chat = ChatModel(load_config({"model_name_or_path": BASE, "template": TEMPLATE}, purpose="infer").inference_spec())
    model = HarnessModel(chat, chat_prompts=True)
    history = [{"role": "system", "content": "Add."}, {"role": "user", "content": "What is 2+3?"}]
    text = model.apply_chat_template(history)
    expected = chat.template.encode_oneturn(chat.tokenizer, history[1:] + [{"role": "assistant", "content": ""}], "Add.")[0]
    context, continuation = model._encode_pair(text, " 5")
    assert context == expected
    assert continuation == chat.tokenizer.encode(" 5", add_special_tokens=False)
    assert "<|im_start|>assistant\n" in text and text.endswith("assistant\n")
    # The template's end of turn stops a reply as well as the end of text.
    assert set(chat.stop_token_ids) <= set(model.stop_token_ids)
    assert HarnessModel(chat, chat_prompts=False).stop_token_ids == (chat.tokenizer.eos_token_id,)
    chat.close()


# ------------------------------------------------------------------ the command


def _write(tmp_path, **keys) -> str:
    path = tmp_path / "eval.yaml"
    path.write_text(json.dumps({"model_name_or_path": BASE, "template": TEMPLATE, **keys}))
    return str(path)


def test_the_command_prints_the_table_and_saves_results_once(tmp_path, capsys):
    save = tmp_path / "results"
    config = _write(tmp_path, task="rf_arith_mc", n_shot=0, eval_limit=4, save_dir=str(save))
    assert cli_main(["eval", config]) == 0
    out = capsys.readouterr().out
    assert "rf_arith_mc" in out and "|acc     |" in out.replace("acc_norm", "")
    summary = json.loads((save / "results.json").read_text())
    assert 0 <= summary["results"]["rf_arith_mc"]["acc,none"] <= 1
    assert len((save / "samples_rf_arith_mc.jsonl").read_text().splitlines()) == 4
    before = (save / "results.json").read_bytes()

    assert cli_main(["eval", config]) == 2  # results are never overwritten
    assert "already holds a results.json" in capsys.readouterr().err
    assert (save / "results.json").read_bytes() == before


@pytest.mark.parametrize("keys, words", [
    ({"task": "rf_arith_mcq"}, ["'rf_arith_mcq' is not an lm-evaluation-harness task", "rf_arith_mc"]),
    ({}, ["task is missing"]),
    ({"task": "mmlu_test", "lang": "zh"}, ["lang: zh", "cmmlu_test"]),
    ({"task": "rf_arith_mc", "task_dir": "/no/such/folder"}, ["task_dir '/no/such/folder' is not a folder"]),
    ({"task": "rf_arith_mc", "n_shot": -1}, ["n_shot"]),
])
def test_mistakes_are_one_paragraph_before_the_model_loads(tmp_path, capsys, keys, words):
    assert cli_main(["eval", _write(tmp_path, **keys)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rayfactory: error:") and "Traceback" not in err
    for word in words:
        assert word in err


def test_llamafactory_task_names_are_the_harness_tasks_of_the_same_data():
    args = EvaluationArguments(task="mmlu_test, ceval_validation,cmmlu_test,rf_arith_mc")
    assert args.task_names() == ["mmlu", "ceval-valid", "cmmlu", "rf_arith_mc"]


def test_a_task_dir_of_the_users_own_is_found(tmp_path):
    """A task YAML in task_dir runs beside the shipped ones (here: ours under another name)."""
    from stages.inference.evaluation import SHIPPED_TASKS

    folder = tmp_path / "mine"
    folder.mkdir()
    text = (open(f"{SHIPPED_TASKS}/rayfactory/rf_arith_mc.yaml").read()
            .replace("task: rf_arith_mc", "task: my_arith").replace("!function loader.", "!function rf_loader."))
    (folder / "my_arith.yaml").write_text(text)
    (folder / "rf_loader.py").write_text(open(f"{SHIPPED_TASKS}/rayfactory/loader.py").read().replace(
        "HERE = os.path.dirname(os.path.abspath(__file__))", f"HERE = {SHIPPED_TASKS + '/rayfactory'!r}"))
    results = _ours({"model_name_or_path": BASE, "template": TEMPLATE}, task="my_arith", task_dir=str(folder), n_shot=0)
    assert len(results["samples"]["my_arith"]) == LIMIT


@pytest.mark.parametrize("keys, words", [
    ({"stage": "rm", "dataset": "arith_pref"}, ["Stage rm trains a reward model", "rayfactory eval"]),
    ({"eval_strategy": "no"}, ["eval_strategy is no"]),
    ({"deepspeed": "configs/deepspeed/ds_z3_config.json"}, ["ZeRO-3", "ZeRO-2"]),
    ({"eval_num_workers": 2}, ["eval_num_workers", "rank 0"]),
])
def test_eval_tasks_during_training_refuses_what_it_cannot_score(tmp_path, keys, words):
    """eval_tasks needs a generating model on one worker, and evaluations to run at."""
    from cluster.config import ConfigError, load_config
    from tests.e2e.conftest import REPO_ROOT, tiny_sft_config

    config = tiny_sft_config(tmp_path / "out", **{"eval_dataset": "arith_eval", "eval_strategy": "steps", "eval_steps": 2,
                                                  "eval_tasks": "rf_arith_mc", **keys})
    if "deepspeed" in keys:
        config["deepspeed"] = f"{REPO_ROOT}/{keys['deepspeed']}"
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    assert caught.value.key == ("eval_num_workers" if "eval_num_workers" in keys else "eval_tasks")
    for word in words:
        assert word in str(caught.value)
    assert load_config({**config, "eval_tasks": None, "deepspeed": None, "eval_num_workers": 1}).evaluation.eval_tasks is None


def test_a_llamafactory_eval_config_loads_as_it_is(tmp_path):
    """LLaMA-Factory's examples/train_lora/llama3_lora_eval.yaml, keys as written: its task name is the
    harness's mmlu, download_mode is a note, the rest are our keys."""
    from cluster.config import load_config

    lf = {"model_name_or_path": BASE, "adapter_name_or_path": None, "template": "fewshot", "task": "mmlu_test",
          "task_dir": None, "save_dir": str(tmp_path / "eval"), "lang": "en", "n_shot": 5, "batch_size": 4,
          "download_mode": "reuse_dataset_if_exists", "finetuning_type": "lora"}
    cfg = load_config(lf, purpose="infer")
    assert cfg.evaluation.task_names() == ["mmlu"] and cfg.evaluation.n_shot == 5
    assert any("download_mode" in note for note in cfg.notes) and any("fewshot" in note for note in cfg.notes)
    assert cfg.data.template is None and not cfg.evaluation.apply_chat_template
