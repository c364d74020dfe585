"""python -m rdkeras.bench {sendrecv} [options]"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rdkeras.bench", description=__doc__)
    sub = parser.add_subparsers(dest="bench", required=True)
    from rdkeras.bench import sendrecv

    sendrecv.add_arguments(sub.add_parser("sendrecv", help=sendrecv.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    return {"sendrecv": sendrecv.run}[args.bench](args)


if __name__ == "__main__":
    sys.exit(main())
