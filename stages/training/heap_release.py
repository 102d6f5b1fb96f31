"""Give the C heap's freed memory back to the system between a step's passes (glibc's malloc_trim).

A CPU worker's tensors live on glibc's heap. Blocks under glibc's mmap threshold (which rises to
32 MiB once a large block has been freed) come from a heap that is only given back from its top,
so the blocks a pass frees stay in the process's memory and the next pass, with other sizes,
extends the heap further. Measured on SmolLM2-135M LoRA dpo with gradient checkpointing
(benchmarks/README.md, "Preference stages side by side"): after a step the live tensors were
19 MB, yet the process held 1.26 GiB more than the weights and imports; malloc_trim(0) handed it
back. Trimming around each pass of a step (the policy's, the reference's) took the peak from 2.93
to 2.59-2.61 GiB in process, and side by side the worker's peak to 0.54-0.56x LLaMA-Factory's. A
trim costs page faults when the memory is used again (~4% of a step there), so it is done only
where memory is what the run is saving: a CPU worker with gradient checkpointing on (which the
memory plan turns on when the model would not fit otherwise). Other allocators and other systems
have no malloc_trim: there it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_heap() -> bool:
    """Return the heap's free pages to the system; whether this C library could."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def releases_heap(training_args) -> bool:
    """Whether a worker trims between passes: on a CPU, with gradient checkpointing on."""
    device = getattr(training_args, "device", None)
    return bool(getattr(training_args, "gradient_checkpointing", False)) and getattr(device, "type", "cpu") == "cpu"


@contextlib.contextmanager
def heap_released(wanted: bool):
    """Trim before and after the block (a forward pass) when ``wanted``."""
    if wanted:
        release_freed_heap()
    try:
        yield
    finally:
        if wanted:
            release_freed_heap()
