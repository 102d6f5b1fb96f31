"""The one base class of every user mistake, in the lowest layer so every layer can raise it.

A ``UserError`` is something the person running RayFactory got wrong (a config key, a data row,
an adapter setting that does not fit the model). Its message is a complete paragraph: what was
wrong, where, and how to fix it. Front doors turn it into their own answer in one place: the CLI
prints it and exits 2, a Ray Serve app answers HTTP 4xx, the web UI shows it. Anything else is
a bug in RayFactory or a library and keeps its traceback.

Errors raised inside Ray tasks and Ray Train workers arrive wrapped; ``find_user_error`` digs
the original out.
"""

from __future__ import annotations


class UserError(ValueError):
    """A user's mistake; the message is meant to be shown as is, without a traceback."""


class ArgumentError(UserError):
    """A value that breaks one argument group's rules; ``key`` lets the config name its source."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(message)

    def __reduce__(self):  # picklable across Ray processes
        return (ArgumentError, (self.key, str(self)))


def find_user_error(exc: BaseException) -> UserError | None:
    """The user mistake behind ``exc``, or None for a bug.

    Ray keeps the original of an error raised in a task as ``cause`` (RayTaskError's text carries
    a remote traceback, so the original is what to show). Ray Train's ``WorkerGroupError`` keeps
    each failed rank's exception in ``worker_failures``; ranks usually fail alike, so the lowest
    rank's is taken.
    """
    # The cause first: Ray's wrapper can itself be an instance of the cause's class
    # (RayTaskError.as_instanceof_cause), with a remote traceback for its text.
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc:
        found = find_user_error(cause)
        if found is not None:
            return found
    if isinstance(exc, UserError):
        return exc
    failures = getattr(exc, "worker_failures", None)
    if isinstance(failures, dict):
        for rank in sorted(failures):
            found = find_user_error(failures[rank])
            if found is not None:
                return found
    return None
