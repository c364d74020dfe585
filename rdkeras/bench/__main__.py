"""python -m rdkeras.bench BENCH [options]: sendrecv, allreduce, algorithms, fit, pipeline, paper, hosts, elastic,
embedding, memory, remat."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from rdkeras._log import to_stderr

    to_stderr()  # an application: rdkeras's messages are shown
    parser = argparse.ArgumentParser(prog="python -m rdkeras.bench", description=__doc__)
    sub = parser.add_subparsers(dest="bench", required=True)
    from rdkeras.bench import (
        algorithms,
        allreduce,
        elastic,
        embedding,
        fit,
        hosts,
        memory,
        paper,
        pipeline,
        remat,
        sendrecv,
    )

    benches = {
        "sendrecv": sendrecv,
        "allreduce": allreduce,
        "algorithms": algorithms,
        "fit": fit,
        "pipeline": pipeline,
        "paper": paper,
        "hosts": hosts,
        "elastic": elastic,
        "embedding": embedding,
        "memory": memory,
        "remat": remat,
    }
    for name, module in benches.items():
        module.add_arguments(sub.add_parser(name, help=(module.__doc__ or name).splitlines()[0]))
    args = parser.parse_args(argv)
    return benches[args.bench].run(args)


if __name__ == "__main__":
    sys.exit(main())
