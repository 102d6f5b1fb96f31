"""Requests taking turns on one transformers model (stages/engines/hf_backend.py).

Each request's ``generate`` runs in a thread of its own; only the holder of the turn runs a
forward pass. After ``turn_s`` seconds, if another request waits, the holder hands the model on
between two tokens and queues behind the others, first come first served. So a short request
waits about one turn per request ahead of it instead of until a long reply ends, and a request's
thread stays blocked (with its KV cache) while it waits: the server bounds how many there are.

A turn sets up on the shared model what belongs to its request, and takes it down before the
next: the adapter (one PeftModel serves every adapter), eval mode, the hook that reads raw
log-probs, and a seeded request's random state (so its samples do not depend on who else drew).
"""

from __future__ import annotations

import collections
import threading
import time

import torch

from .types import GenerationRequest

TURN_S = 0.25  # serve's serve_turn_s sets it per engine


class Abandoned(Exception):
    """Raised in a generation whose consumer left while it waited for its next turn."""


class Turns:
    """Whose turn it is on the model, first come first served. The holder keeps it until ``due``
    (someone waits and ``turn_s`` has passed), hands it on between two tokens and queues again."""

    def __init__(self, turn_s: float):
        self.turn_s = turn_s
        self._cond = threading.Condition()
        self._line: collections.deque = collections.deque()  # waiting requests, first in line first
        self._busy = False
        self._since = 0.0

    def take(self, cancel: threading.Event) -> bool:
        """Block until it is this caller's turn: True; False if ``cancel`` was set meanwhile."""
        ticket = object()
        with self._cond:
            self._line.append(ticket)
            try:
                while not cancel.is_set() and (self._busy or self._line[0] is not ticket):
                    self._cond.wait()
                if cancel.is_set():
                    return False
                self._busy, self._since = True, time.monotonic()
                return True
            finally:
                self._line.remove(ticket)
                self._cond.notify_all()  # the next in line may be first now

    def give(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def due(self) -> bool:
        with self._cond:
            return bool(self._line) and time.monotonic() - self._since >= self.turn_s

    def wake(self) -> None:
        """Let waiting threads look at their cancel flags again."""
        with self._cond:
            self._cond.notify_all()


class Turn:
    """One request's hold on the model: what its turn sets up on the shared model, and takes down
    again before the next request's turn."""

    def __init__(self, engine, request: GenerationRequest, cancel: threading.Event):
        self.engine, self.request, self.cancel = engine, request, cancel
        self.observer = None  # the request's streamer: the log-prob hook hands it the logits
        self.holding = False
        self._rng = None  # a seeded request's random state between its turns
        self._hook = None
        self._was_training = self._adapters_off = False

    def begin(self) -> bool:
        """Wait for the model, then set it up for this request; False: cancelled while waiting."""
        if not self.engine.turns.take(self.cancel):
            return False
        self.holding = True
        try:
            self._set_up()
        except BaseException:
            self.end()
            raise
        return True

    def _set_up(self) -> None:
        model, sampling = self.engine.model, self.request.sampling
        self._was_training = model.training
        model.eval()  # no dropout while generating; a policy being trained goes back to training after
        self._adapters_off = self.engine.select_adapter(self.request.adapter)
        if sampling.logprobs is not None:
            self._hook = model.get_output_embeddings().register_forward_hook(
                lambda _m, _i, out: self.observer.see_logits(out))
        if sampling.seed is not None:
            if self._rng is None:
                torch.manual_seed(sampling.seed)
            else:  # the sampling goes on as if no other request had drawn in between
                torch.set_rng_state(self._rng[0])
                if self._rng[1] is not None:
                    torch.cuda.set_rng_state_all(self._rng[1])

    def end(self) -> None:
        """Take this request's set-up down and hand the model on (nothing if not holding it)."""
        if not self.holding:
            return
        try:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            if self.request.sampling.seed is not None:
                self._rng = (torch.get_rng_state(),
                             torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)
            if self._adapters_off:
                self.engine.rest_adapters()
            self.engine.model.train(self._was_training)
        finally:
            self.holding = False
            self.engine.turns.give()

    def between_steps(self) -> None:
        """After a step's tokens went out: hand the model on if another request's turn is due."""
        if self.engine.turns.due():
            self.end()
            if not self.begin():
                raise Abandoned
