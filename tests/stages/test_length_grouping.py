"""Length-grouped sampling (LLaMA-Factory's group_by_length, transformers 5's
train_sampling_strategy: group_by_length): the YAML key reaches the Trainer, whose batches then
hold examples of similar length (less padding, or fewer padding-free rows of uneven width)."""

from __future__ import annotations

import datasets
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer
from transformers.trainer_pt_utils import LengthGroupedSampler

from cluster.config import load_config


def _config(**extra):
    return load_config({"model_name_or_path": "tiny:llama", "dataset": "arith_train", "output_dir": "x", **extra})


def test_llamafactory_group_by_length_becomes_the_sampling_strategy():
    run = _config(group_by_length=True)
    assert run.training.values["train_sampling_strategy"] == "group_by_length"
    assert "translated group_by_length: True to train_sampling_strategy: 'group_by_length'." in run.notes
    assert "train_sampling_strategy" not in _config(group_by_length=False).training.values


def _spread(lengths, batches):
    """The mean, over batches, of longest minus shortest example."""
    return sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)


def test_grouped_batches_hold_similar_lengths(tmp_path):
    torch.manual_seed(0)
    lengths = [int(n) for n in torch.randint(4, 200, (256,))]
    data = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in lengths]})
    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    spreads = {}
    for strategy in ("random", "group_by_length"):
        args = _config(train_sampling_strategy=strategy, per_device_train_batch_size=8, use_cpu=True,
                       output_dir=str(tmp_path)).training.build(use_cpu=True)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        sampler = trainer._get_train_sampler()
        assert isinstance(sampler, LengthGroupedSampler) == (strategy == "group_by_length")
        order = list(iter(sampler))
        assert sorted(order) == list(range(256))  # every example once
        spreads[strategy] = _spread(lengths, [order[i:i + 8] for i in range(0, 256, 8)])
    assert spreads["group_by_length"] < 0.25 * spreads["random"], spreads
