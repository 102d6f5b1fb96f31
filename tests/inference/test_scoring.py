"""RewardScorer gives each reply the score stage rm's own scoring gives it."""

from __future__ import annotations

import pytest

from registries.datasets.data_args import DataArguments
from registries.tokenize import preprocess_pairwise
from stages.run_args import ModelArguments
from stages.inference.chat_model import ChatInputError
from stages.inference.loading import InferenceSpec
from stages.inference.scoring import RewardScorer, is_reward_output

from .conftest import BASE, TEMPLATE
from .test_export import make_reward_output

CUTOFF = 80  # short enough that the long rows below are cut, as training cut them

ROWS = [  # (prompt, chosen, rejected); chosen is the longer reply (it sets the cut, see rm's pairwise encoder)
    ([{"role": "user", "content": "What is 2 + 3?"}], "2 + 3 is 5.", "7"),
    ([{"role": "user", "content": "Name a colour."}], "Blue, like the sky on a clear day.", "no"),
    ([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"},
      {"role": "user", "content": "count to ten please, one number per word"}],
     "one two three four five six seven eight nine ten", "1 2 3"),
]


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    return make_reward_output(tmp_path_factory.mktemp("scoring") / "rm", seed=5)


@pytest.fixture(scope="module")
def scorer(reward):
    spec = InferenceSpec(model=ModelArguments(model_name_or_path=BASE, adapter_name_or_path=[reward]),
                         data=DataArguments(cutoff_len=CUTOFF))
    return RewardScorer(spec)


def rm_stage_scores(reward, system: str | None):
    """What stage rm computes: the registries' pairwise tokenizer on the training tokenizer and
    template, then value_head.score_pairs."""
    from stages.loading import load_tokenizer_and_template
    from stages.training.value_head import score_pairs
    from stages.loading import load_reward_model

    data_args = DataArguments(template=TEMPLATE, cutoff_len=CUTOFF)
    tokenizer, template = load_tokenizer_and_template(ModelArguments(model_name_or_path=BASE), data_args)
    batch = {"_prompt": [p for p, _, _ in ROWS],
             "_response": [[{"role": "assistant", "content": c}, {"role": "assistant", "content": r}]
                           for _, c, r in ROWS],
             "_system": [system] * len(ROWS)}
    columns = preprocess_pairwise(batch, tokenizer=tokenizer, template=template, data_args=data_args)
    pairs = [{k: columns[k][i] for k in columns} for i in range(len(ROWS))]
    model, _ = load_reward_model(reward)
    chosen, rejected = score_pairs(model, pairs, tokenizer.pad_token_id)
    return chosen.tolist(), rejected.tolist(), [len(ids) for ids in columns["chosen_input_ids"]]


LONG_SYSTEM = ("You are a careful judge: read the question and the reply, then decide how helpful, honest and "
               "correct the reply is.")  # longer than qwen's default system, so rows are still cut


@pytest.mark.parametrize("system", [None, LONG_SYSTEM])
def test_scores_equal_the_rm_stage_scoring(reward, scorer, system):
    chosen, rejected, lengths = rm_stage_scores(reward, system)
    assert CUTOFF in lengths and min(lengths) < CUTOFF  # cut and uncut rows, padded together
    conversations = [p + [{"role": "assistant", "content": c}] for p, c, _ in ROWS]
    conversations += [p + [{"role": "assistant", "content": r}] for p, _, r in ROWS]
    scores = scorer.score(conversations, system=system)
    assert scores[: len(ROWS)] == pytest.approx(chosen, abs=1e-6, rel=0)
    # A cut pair cuts its shorter reply to the pair's budget, which a reply scored alone cannot
    # know: the rejected replies match wherever the pair was not cut.
    uncut = [i for i, n in enumerate(lengths) if n < CUTOFF]
    assert [scores[len(ROWS) + i] for i in uncut] == pytest.approx([rejected[i] for i in uncut], abs=1e-6, rel=0)
    assert len({round(s, 4) for s in chosen}) == len(ROWS)  # the head tells the replies apart


def test_a_conversation_must_end_with_the_reply(scorer):
    with pytest.raises(ChatInputError, match="must end with the assistant reply"):
        scorer.score([[{"role": "user", "content": "hi"}]])


def test_is_reward_output(reward, tmp_path):
    from .conftest import make_adapter_output

    assert is_reward_output(reward)
    assert not is_reward_output(make_adapter_output(tmp_path / "sft", seed=1))
