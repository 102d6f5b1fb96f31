"""Inference: load a trained output and generate from it (ChatModel, over the engines of
stages/engines), merge LoRA (export), score generations (predict metrics)."""
