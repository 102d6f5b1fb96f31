"""What the recipes train with: which parameters train (adapters), collators, padding-free attention,
chunked loss, the memory plan, the value head, the jsonl log, checkpoints (one protocol for every
stage) and the files a finished stage leaves."""
