"""What a worker or a controller loop runs, placement-free (fabric/ decides where):

    table.py       the stage table: every fact about a stage, one entry each
    job.py         JobSpec (the typed config every process gets) and StageJob (a worker's job)
    run_args.py    the model, fine-tuning, generation and trainer halves of a config
    loading.py     tokenizer + template + model with its adapter, for training and inference alike
    recipes/       one module per stage, read top to bottom
    training/      what the recipes train with: adapters, collators, losses, checkpoints, outputs
    rl/            what the RL stages share: options, advantage and loss math, rewards, the roles' workers
    engines/       generation: one token-ids interface, a transformers and a vLLM backend
    inference/     ChatModel (chat, serve, predict), export, scoring
"""
