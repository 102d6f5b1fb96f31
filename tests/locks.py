"""A lock for the caches the tests fill on first use (the LLaMA-Factory venv, the npm tokenizers):
the tests that start no Ray run on two pytest-xdist workers, and two workers must not build the
same cache at once. An exclusive ``flock`` on a file beside the caches, released when the block ends
or the process dies."""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path


@contextlib.contextmanager
def cache_lock(name: str):
    from registries.models.tiny import cache_root

    folder = cache_root() / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    with open(Path(folder) / f"{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
