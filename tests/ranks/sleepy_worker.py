"""A worker that records its pid and its place in the job, and the pid of a child of its own (a data loader's,
say), then waits to be killed."""

import os
import subprocess
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
rank = os.environ["RDKERAS_RANK"]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
(out / f"child-{rank}").write_text(str(child.pid))
place = f"{os.getpid()} {os.environ['LOCAL_RANK']} {os.environ['LOCAL_WORLD_SIZE']} {os.environ['RDKERAS_WORLD_SIZE']}"
(out / f"rank-{rank}.tmp").write_text(place)
(out / f"rank-{rank}.tmp").rename(out / f"rank-{rank}")
if rank == "0":
    for i in range(3):  # a progress bar as Keras draws it: back to column 0, redraw
        sys.stdout.write("\b" * 8 + "\r" + f"step {i}/3")
        sys.stdout.flush()
        time.sleep(0.05)
    sys.stdout.write("\n")
    sys.stdout.flush()
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 300)
