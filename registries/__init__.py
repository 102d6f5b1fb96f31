"""RayFactory's shared library: chat templates, datasets, per-stage tokenization, model facts.

Pure Python (no Ray): every stage, the server and the web UI import it.
"""
