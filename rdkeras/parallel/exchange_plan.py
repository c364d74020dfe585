"""The data-parallel plan: what each step of an attached model exchanges, and how (TensorBoard's text tab and
``strategy.plan`` show it; rdkeras.parallel.data_parallel makes it)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ExchangePlan:
    """The data-parallel plan: the gradients every step exchanges, and how."""

    mode: str  # "allreduce" or "ps"
    workers: int
    transport: str
    global_batch: int | None
    variables: list[tuple[str, tuple, str, int]]  # (path, shape, dtype, bytes) of each trainable variable
    bucket_bytes: int
    algorithm: tuple[str, str] = ("ring", "")  # (allreduce algorithm, why it was chosen)
    overlap_bytes: int = 0  # gradient buckets exchanged as backprop produces them (0: one exchange after it)

    @property
    def gradient_bytes(self) -> int:
        return sum(v[3] for v in self.variables)

    @property
    def bytes_per_worker(self) -> int:
        """Bytes each worker sends (and receives) per step in a ring allreduce."""
        return 2 * (self.workers - 1) * self.gradient_bytes // self.workers

    def text(self) -> str:
        """The plan as Markdown (TensorBoard's text tab renders it)."""
        batch, workers, total = self.global_batch, self.workers, self.gradient_bytes
        lines = [
            f"**data parallel**, {workers} workers, transport `{self.transport}`, mode `{self.mode}`"
            + (f", global batch {batch} ({batch // workers} per worker)" if batch else ""),
            "",
        ]
        if self.mode == "allreduce":
            passes = max(1, math.ceil(total / self.bucket_bytes))
            name, why = self.algorithm
            if name == "ring":
                lines.append(
                    f"Each step: one ring allreduce of {total:,} gradient bytes in {passes} pass(es) of at most "
                    f"{self.bucket_bytes:,} bytes; each worker sends and receives {self.bytes_per_worker:,} bytes."
                    + (f" Allreduce: {why}." if why and why != "one worker" else "")
                )
            else:
                shown = "recursive-doubling" if name == "doubling" else name
                lines.append(f"Each step: a {shown} allreduce of {total:,} gradient bytes ({why}).")
            if workers > 1:
                lines[-1] += (
                    f" Overlap: buckets of {self.overlap_bytes:,} bytes start as backprop produces them."
                    if self.overlap_bytes > 0
                    else " One exchange after backprop (overlap off: `overlap_bytes` turns it on)."
                )
        else:
            lines.append(
                f"Each step: gradients ({total:,} bytes) pushed one-sidedly to the parameter server owning each "
                f"variable (sharded over the {workers} workers); updated parameters pulled back."
            )
        rows = [f"| {path} | {shape} | {dtype} | {nbytes:,} |" for path, shape, dtype, nbytes in self.variables]
        lines += ["", "| variable | shape | dtype | bytes |", "|---|---|---|---|", *rows]
        return "\n".join(lines)
