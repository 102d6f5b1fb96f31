"""Command lines whose ``key=value`` overrides may come anywhere after the config.

argparse takes a ``nargs="*"`` positional only in one run, so ``train cfg.yaml --verbose lr=1e-4``
or ``submit cfg.yaml --address URL -- lr=1e-4`` (the form ``ray job submit`` users know) would
be refused as unrecognized arguments. Standard library only: ``rayfactory version`` and the job
commands must not import torch.
"""

from __future__ import annotations

import argparse


def parse_arguments(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with ``key=value`` items after the options (or after ``--``)
    added to the command's ``overrides``. Anything else argparse does not know fails as usual."""
    args, extra = parser.parse_known_args(argv)
    extra = [item for item in extra if item != "--"]
    if not extra:
        return args
    if hasattr(args, "overrides") and all("=" in item and not item.startswith("-") for item in extra):
        args.overrides = [*args.overrides, *extra]
        return args
    return parser.parse_args(argv)  # argparse's own message and exit status for what it does not know


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser. A missing config file is said in words, with an example of the command
    (``config_example``), not as argparse's "the following arguments are required: config, key=value"
    (Python before 3.12 counts an empty ``nargs="*"`` positional as missing too)."""

    config_example: str | None = None

    def error(self, message: str):
        if self.config_example and message.startswith("the following arguments are required: config"):
            message = (f"a config file is needed (a YAML file of LLaMA-Factory's keys, as in configs/), e.g. "
                       f"`{self.config_example}`; key=value overrides may follow it.")
        super().error(message)
