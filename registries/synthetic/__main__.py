"""``python -m registries.synthetic [--out data] [--check]``: write (or verify) the demo datasets."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .generate import SEED, build, build_eval_tasks, write


def _stale(out_dir: str, seed: int) -> list[str]:
    """Files (and dataset_info.json entries) that differ from what the generator would write."""
    stale = []
    files = build(seed)
    texts = {f.file_name: f.text for f in files} | build_eval_tasks(seed)
    for name, text in texts.items():
        path = os.path.join(out_dir, name)
        if not os.path.isfile(path):
            stale.append(f"{path} (missing)")
            continue
        with open(path, encoding="utf-8", newline="") as fh:
            if fh.read() != text:
                stale.append(path)
    info_path = os.path.join(out_dir, "dataset_info.json")
    info = json.load(open(info_path, encoding="utf-8")) if os.path.isfile(info_path) else {}
    stale += [f"{info_path} entry {f.name!r}" for f in files if info.get(f.name) != f.entry]
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m registries.synthetic", description=__doc__)
    parser.add_argument("--out", default="data", help="folder to write into (default: data)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--check", action="store_true", help="only report files that differ; exit 1 if any")
    args = parser.parse_args(argv)
    if args.check:
        stale = _stale(args.out, args.seed)
        for line in stale:
            print(f"differs: {line}")
        print("demo data is up to date" if not stale else f"{len(stale)} difference(s); run without --check to rewrite")
        return 1 if stale else 0
    written = write(args.out, args.seed)
    print(f"wrote {len(written)} files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
