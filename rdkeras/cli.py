"""The ``rdkeras`` command: ``rdkeras train|launch|bench|doctor|postmortem ...``, the ``python -m`` entry points by
name."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

# Each subcommand: what it does, and the module whose main(argv) it runs with the rest of the command line.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("the training app (Hydra): recipes, config groups, sweeps; as python -m rdkeras.train", "rdkeras.train"),
    "launch": ("start N workers of a script or module on this node; as python -m rdkeras.launch", "rdkeras.launch"),
    "bench": ("benchmarks, side by side in one run; as python -m rdkeras.bench", "rdkeras.bench.__main__"),
    "doctor": ("what this machine can do: versions, viable transports, RDMA devices", "rdkeras.doctor"),
    "postmortem": ("line up the ranks' flight-recorder dumps in DIR: which rank diverged first", "rdkeras.postmortem"),
}


def _entry(module: str) -> Callable[[list[str]], int]:
    import importlib

    if module == "rdkeras.doctor":
        from rdkeras import doctor

        return lambda argv: doctor.run()
    if module == "rdkeras.train":
        from rdkeras.train.app import main as train

        return train
    return importlib.import_module(module).main


def main(argv: list[str] | None = None) -> int:
    from rdkeras._log import to_stderr

    to_stderr()  # an application: rdkeras's messages are shown
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS and argv[0] != "doctor":  # the rest is the module's own command line
        return int(_entry(COMMANDS[argv[0]][1])(argv[1:]) or 0)
    parser = argparse.ArgumentParser(prog="rdkeras", description="RDMA-style distributed training for Keras")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, (what, _) in COMMANDS.items():
        sub.add_parser(name, help=what)
    args = parser.parse_args(argv)
    return int(_entry(COMMANDS[args.command][1])([]) or 0)


if __name__ == "__main__":
    sys.exit(main())
