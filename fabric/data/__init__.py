"""The data path: every way a run's rows are read, aligned, mixed, split and tokenized.

``prepare.py`` is the entry point and picks the way (``prepare_datasets``, ``check_data``);
``ray_data.py`` runs it in Ray Data tasks, ``tokenize_in_driver.py`` in the driver process for small
files, ``streaming.py`` as a lazy stream the workers pull from as they train (a worker's share:
``streamed_shard.py``), ``cache.py`` saves and reuses ``tokenized_path``; ``common.py`` holds
what they share. Imports run one way: prepare -> the ways -> common.
"""
