"""The verbs transport for real: conformance, failure and training tests, run inside the SoftRoCE VM.

Needs the VM prepared by ``bash tests/verbs/setup.sh`` (``.ci/run`` does it) and an
rdkeras built with rdma-core's headers; elsewhere this test is skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rdkeras import _engine

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CACHE = Path(os.environ.get("RDKERAS_VERBS_CACHE", "/var/cache/rdkeras-verbs"))


def _not_ready() -> str | None:
    if os.environ.get("RDKERAS_IN_VM"):
        return "already inside the VM"
    if "verbs" not in _engine.native_transports():
        return "rdkeras was built without the verbs transport (apt install libibverbs-dev, then reinstall)"
    if not shutil.which("qemu-system-x86_64") or not (CACHE / "current").exists():
        return f"the SoftRoCE VM is not set up: run `bash {HERE / 'setup.sh'}` (as root)"
    return None


# Slow (about 7 minutes under emulation): .ci/run runs it as a step of its own, before the default test run.
@pytest.mark.slow
@pytest.mark.timeout(1300)  # the VM emulates its CPU: TensorFlow alone takes a minute to import there
@pytest.mark.skipif(_not_ready() is not None, reason=str(_not_ready()))
def test_verbs_conformance_inside_the_softroce_vm():
    # Every verbs test but the 3-rank ring (70 s under emulation; the 2-rank ring and
    # training in both data modes cover the same paths), to keep CI's VM step short.
    guest = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        "verbs and not verbs-3",
        "tests/multiproc/test_conformance.py",
        "tests/multiproc/test_failures.py",
        "tests/multiproc/test_hostile.py",
        "tests/multiproc/test_data_parallel.py",
    ]
    # 4 GiB: two TensorFlow processes, each training four times, plus the guest's memory-only root.
    done = subprocess.run(
        [sys.executable, str(HERE / "run_in_vm.py"), "--mem", "4G", "--timeout", "1200", "--", *guest],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1260,
    )
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail.split(" passed")[-1].split("\n")[0], tail
