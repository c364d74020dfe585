"""The engine's C++ unit tests (csrc/tests, doctest), run by ctest in the build .ci/run makes.

They cover what Python processes cannot reach directly: region-table generations, size classes, the
ring's layout and chunking and RingAllreduce itself on ranks that are threads, SHA-256/HMAC vectors, the
transport handshake and the verbs device choice (against a fake libibverbs). Building them takes
minutes, so the test suite does not: ``.ci/run`` builds build/cpp-tests (and runs ctest) before pytest;
here, where that build exists, it is brought up to date with the sources and run again. Without it the
test is skipped saying how to make it, except under CI, where that is a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "build" / "cpp-tests"
HOW = "cmake -S . -B build/cpp-tests -DRDKERAS_PYTHON=OFF -DRDKERAS_TESTS=ON && cmake --build build/cpp-tests"


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, **kwargs)


@pytest.mark.timeout(900)
def test_engine_cpp_unit_tests_pass_under_ctest():
    if not (BUILD / "CTestTestfile.cmake").exists() or not shutil.which("ctest"):
        if os.environ.get("CI"):
            pytest.fail(f"no C++ test build in {BUILD}: .ci/run makes it before pytest")
        pytest.skip(f"no C++ test build in {BUILD}: .ci/run makes it (or: {HOW}; needs doctest-dev)")
    built = _run(["cmake", "--build", str(BUILD), "--parallel", "2"])  # nothing to do unless a source changed
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-2000:]
    ran = _run(["ctest", "--test-dir", str(BUILD), "--output-on-failure"], timeout=600)
    assert ran.returncode == 0, ran.stdout[-6000:]
    assert "100% tests passed" in ran.stdout, ran.stdout[-2000:]
