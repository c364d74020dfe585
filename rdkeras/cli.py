"""The ``rdkeras`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from rdkeras._log import to_stderr

    to_stderr()  # an application: rdkeras's messages are shown
    parser = argparse.ArgumentParser(prog="rdkeras", description="RDMA-style distributed training for Keras")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="what this machine can do: versions, viable transports, RDMA devices")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from rdkeras import doctor

        return doctor.run()
    return 2


if __name__ == "__main__":
    sys.exit(main())
