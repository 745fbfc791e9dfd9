"""What a reader crosses to follow one command from the CLI to its first optimizer step: Lantern's source files and
functions that run on the way (what runs at import aside), traced with ``sys.setprofile`` (run folders, W&B, the plan line
included).

    python benchmarks/reading_path.py --out runs/bench/reading-sft sft configs/sft/tiny.yaml trainer.max_steps=1

Prints the files in the order they are first entered, with how many of their functions ran, and writes the same as
JSON (``--out``). Run it with ``PYTHONPATH`` set to another checkout to measure that one with the same interpreter.
The count depends only on the code and the command, not on the machine.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from pathlib import Path

PACKAGES = ("models", "data", "trainer", "alignment")


def _in_function(frame) -> bool:
    """A function's frame, not a module or class body's, nor the import system's: what importlib calls (a package
    ``__getattr__`` that a module body's ``from package import submodule`` asks) runs at import."""
    return (
        frame is not None
        and bool(frame.f_code.co_flags & inspect.CO_OPTIMIZED)
        and not frame.f_globals.get("__name__", "").startswith("importlib")
    )


def trace(command: list[str]) -> dict[str, list[str]]:
    """Run ``lantern COMMAND`` in this process; the Lantern functions called per file until the first optimizer step."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from alignment.commands.cli import main

    packages = tuple(f"{Path(__import__(name).__file__).resolve().parent}{os.sep}" for name in PACKAGES)
    root = Path(packages[0]).parent
    files: dict[str, list[str]] = {}
    stepped: list[bool] = []

    def profile(frame, event, _arg):
        # Only calls made by functions: module and class bodies, and what they call, run at import, not on the path.
        if event != "call" or stepped or not _in_function(frame) or not _in_function(frame.f_back):
            return
        code = frame.f_code
        if not code.co_filename.startswith(packages):
            return
        functions = files.setdefault(os.path.relpath(code.co_filename, root), [])
        name = getattr(code, "co_qualname", code.co_name)  # co_qualname: Python 3.11+
        if name not in functions:
            functions.append(name)

    def first_step(_optimizer, _args, _kwargs) -> None:
        stepped.append(True)
        sys.setprofile(None)
        raise SystemExit(0)  # after the step, so a closure's forward and backward (Lightning's) are on the path

    register_optimizer_step_post_hook(first_step)
    sys.setprofile(profile)
    try:
        main(command)
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
    if not stepped:
        raise SystemExit(f"lantern {' '.join(command)} ended without an optimizer step")
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs=argparse.REMAINDER, help="a lantern command and its arguments")
    parser.add_argument("--out", type=Path, default=None, help="folder for reading_path.json")
    args = parser.parse_args()
    files = trace(args.command)
    for path, functions in files.items():
        print(f"{len(functions):4d}  {path}")
    print(f"{len(files)} files, {sum(map(len, files.values()))} functions")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "reading_path.json").write_text(json.dumps(files, indent=1) + "\n")


if __name__ == "__main__":
    main()
