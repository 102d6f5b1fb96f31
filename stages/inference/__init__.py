"""Inference: load a trained output and generate from it (ChatModel), merge LoRA (export),
score generations (predict metrics). Engines behind one interface: transformers and vLLM."""
