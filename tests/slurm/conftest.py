"""A real one-node SLURM cluster on this machine: munged, slurmctld and slurmd from Debian's packages.

Everything lives in a temporary folder (config, state, logs, munge socket) on
ports of its own, so it neither needs nor disturbs a system SLURM; it is torn
down after the session, jobs first. Skips with the reason where SLURM is not
installed (``apt-get install slurm-wlm munge``; .ci/run does it) or will not start.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd")
START_TIMEOUT_S = 60


@dataclass
class Slurm:
    root: Path
    env: dict  # the environment every SLURM command of the tests runs with (SLURM_CONF)

    def run(self, *argv: str, timeout: float = 600, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, env={**self.env, **(env or {})}, **kw
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(pid_files: list[Path]) -> None:
    """Stops the daemons together (each takes seconds to shut down): SIGTERM, then SIGKILL what is left."""
    pids = []
    for pid_file in pid_files:
        with contextlib.suppress(OSError, ValueError, IndexError):
            pids.append(int(pid_file.read_text().split()[0]))
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        end = time.monotonic() + wait
        while pids and time.monotonic() < end:
            pids = [pid for pid in pids if _alive(pid)]
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _config(root: Path, munge_socket: Path) -> str:
    host = socket.gethostname().split(".")[0]
    cpus = os.cpu_count() or 1
    return "\n".join(
        [
            "ClusterName=rdkeras-test",
            f"SlurmctldHost={host}",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmUser=root",
            "SlurmdUser=root",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "ReturnToService=2",
            "KillWait=5",
            "MinJobAge=0",  # records kept for the whole session; sbatch --wait then polls every 2 s (not 2, 8, 32 s)
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool",
            f"SlurmctldPidFile={root}/slurmctld.pid",
            f"SlurmdPidFile={root}/slurmd.pid",
            f"SlurmctldLogFile={root}/slurmctld.log",
            f"SlurmdLogFile={root}/slurmd.log",
            f"NodeName={host} CPUs={cpus} State=UNKNOWN",
            f"PartitionName=debug Nodes={host} Default=YES OverSubscribe=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> Slurm:
    missing = [d for d in (*DAEMONS, "srun", "sbatch", "sinfo") if not shutil.which(d)]
    if missing:
        pytest.skip(f"SLURM not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the test SLURM cluster runs its daemons as root")
    root = Path(tmp_path_factory.mktemp("slurm"))
    for sub in ("state", "spool", "munge"):
        (root / sub).mkdir()
    key = root / "munge" / "munge.key"  # this cluster's own credential key, not the system's
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = root / "munge" / "socket"
    conf = root / "slurm.conf"
    conf.write_text(_config(root, sock))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RDKERAS_"))}
    env["SLURM_CONF"] = str(conf)
    cluster = Slurm(root, env)
    pid_files = [root / "munged.pid", root / "slurmctld.pid", root / "slurmd.pid"]
    try:
        started = [
            ["munged", "--force", f"--socket={sock}", f"--key-file={key}", f"--pid-file={pid_files[0]}",
             f"--log-file={root}/munged.log", f"--seed-file={root}/munge/seed"],
            ["slurmctld", "-c", "-f", str(conf)],
            ["slurmd", "-f", str(conf)],
        ]  # fmt: skip
        for argv in started:
            done = cluster.run(*argv, timeout=60)
            if done.returncode != 0:
                pytest.skip(f"SLURM did not start: {' '.join(argv[:1])}: {(done.stderr or done.stdout).strip()[-500:]}")
        deadline = time.monotonic() + START_TIMEOUT_S
        state = ""
        while time.monotonic() < deadline:
            state = cluster.run("sinfo", "-h", "-o", "%T", timeout=30).stdout.strip()
            if state == "idle":
                break
            time.sleep(0.5)
        else:
            logs = (root / "slurmctld.log").read_text()[-1000:] if (root / "slurmctld.log").exists() else ""
            pytest.skip(f"SLURM node not idle after {START_TIMEOUT_S} s (state {state!r}): {logs}")
        yield cluster
    finally:
        cluster.run("scancel", "--full", "--user", "root", timeout=30)
        time.sleep(0.5)
        _stop(pid_files)
