"""Long runs do not drift: resources stay flat over thousands of steps, and engines created and
closed one after another leave nothing behind. The default run does short versions; the soak
proper is ``-m slow`` (figures in docs/reliability.md)."""

from __future__ import annotations

import pytest

from tests.conftest import run_ranks


def _flat(samples: list[dict], rss_mb: float, thread_slack: int = 0) -> list[str]:
    first, problems = samples[0], []
    for s in samples[1:]:
        for key in ("fds", "dev_shm", "registrations", "pool_bytes_reserved"):
            if s[key] != first[key]:
                problems.append(f"step {s['step']}: {key} {first[key]} -> {s[key]}")
        for key in ("threads", "py_threads"):
            if not first[key] <= s[key] <= first[key] + thread_slack:
                problems.append(f"step {s['step']}: {key} {first[key]} -> {s[key]}")
        if s["rss_mb"] - first["rss_mb"] > rss_mb:
            problems.append(f"step {s['step']}: RSS grew {s['rss_mb'] - first['rss_mb']:.1f} MB")
    return problems


def _soak(transport: str, world: int, steps: int, every: int, rss_mb: float, timeout: float) -> list:
    results = run_ranks(
        "soak", world, transport=transport, timeout=timeout, steps=steps, sample_every=every, warmup=200
    )
    for r in results:
        v = r.value
        assert v["checks"] == v["expected"], f"rank {r.rank}: {v['checks']} of {v['expected']} transfers right"
        # grpc's server starts the threads of its pool (8 at most) as concurrent calls need them.
        problems = _flat(v["samples"], rss_mb, thread_slack=8 if transport == "grpc" else 0)
        assert not problems, f"rank {r.rank} drifted: {problems}"
    return results


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_thousand_steps_keep_resources_flat(transport):
    _soak(transport, 3, 1000, 200, rss_mb=8, timeout=240)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("transport", ["shm", "tcp", "grpc"])
def test_soak(transport):
    steps = 2000 if transport == "grpc" else 10000
    results = _soak(transport, 3, steps, 1000, rss_mb=8, timeout=3000)
    for r in results:
        first, last = r.value["samples"][0], r.value["samples"][-1]
        print(
            f"\nsoak {transport} rank {r.rank}: steps 200 -> {last['step']}: RSS {first['rss_mb']:.1f} -> "
            f"{last['rss_mb']:.1f} MB, fds {first['fds']} -> {last['fds']}, threads {first['threads']} -> "
            f"{last['threads']}, registrations {first['registrations']} -> {last['registrations']}, "
            f"/dev/shm {first['dev_shm']} -> {last['dev_shm']}"
        )


@pytest.mark.parametrize(("transport", "world", "cycles"), [("shm", 1, 25), ("shm", 2, 10), ("tcp", 2, 10)])
def test_engines_created_and_closed_in_a_row_leave_nothing(transport, world, cycles):
    for r in run_ranks("engine_cycles", world, transport=transport, timeout=240, cycles=cycles):
        before, after = r.value["before"], r.value["after"]
        for key in ("fds", "threads", "py_threads", "dev_shm"):
            assert after[key] == before[key], (
                f"rank {r.rank}: {key} {before[key]} -> {after[key]} after {cycles}; threads "
                f"{before['thread_names']} {before['os_thread_names']} -> "
                f"{after['thread_names']} {after['os_thread_names']}"
            )
        assert after["rss_mb"] - before["rss_mb"] < 16, (before, after)
        assert r.value["open_engines"] == 0, r.value  # every closed engine left the exit hook's list
