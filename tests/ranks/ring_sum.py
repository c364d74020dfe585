"""Each rank adds rank+1 in one ring allreduce and prints the sum (1+2+...+N) and its local rank."""

import os

import numpy as np

import rdkeras

with rdkeras.Engine() as eng:
    ring = eng.ring("sum", 1 << 12)
    (out,) = ring([np.full(4, float(eng.rank + 1), np.float32)])
    total = float(out[0])
    print(f"rank {eng.rank} local {os.environ['LOCAL_RANK']} of {eng.world_size}: sum {total}", flush=True)
