"""The memory bench's per-process caps (rdkeras.bench.cgroup), with a temporary folder standing in for the cgroup
v1 memory root: what a group is given, what is read back, and that groups go away however the run ends."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from rdkeras.bench import cgroup


def _root(tmp_path: Path, memsw: bool = True) -> Path:
    root = tmp_path / "memory"
    root.mkdir()
    (root / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    if memsw:
        (root / "memory.memsw.limit_in_bytes").write_text("9223372036854771712\n")
    return root


def test_a_root_without_the_memory_controller_is_reported_unavailable(tmp_path):
    assert "no cgroup v1 memory controller" in (cgroup.unavailable(tmp_path / "absent") or "")
    assert cgroup.unavailable(_root(tmp_path)) is None


@pytest.mark.parametrize("memsw", [True, False])
def test_a_group_is_capped_with_swap_counted_where_the_kernel_counts_it(tmp_path, memsw):
    root = _root(tmp_path, memsw)
    group = cgroup.create("bench-1-0", 2500 << 20, root)
    assert (group / "memory.limit_in_bytes").read_text() == str(2500 << 20)
    assert (group / "memory.memsw.limit_in_bytes").exists() == memsw
    if memsw:
        assert (group / "memory.memsw.limit_in_bytes").read_text() == str(2500 << 20)


def test_a_rank_joins_its_own_group_by_the_prefix(tmp_path, monkeypatch):
    root = _root(tmp_path)
    with cgroup.groups("bench-9", 2, 1 << 30, root):
        assert cgroup.join_rank(None) is None
        monkeypatch.setenv("RDKERAS_RANK", "1")
        monkeypatch.setenv("RDKERAS_WORLD_SIZE", "2")
        assert cgroup.join_rank(str(root / "bench-9")) == root / "bench-9-1"
        assert (root / "bench-9-1" / "cgroup.procs").read_text() == str(os.getpid())
        assert not (root / "bench-9-0" / "cgroup.procs").exists()


def test_the_kernels_counts_are_read_back_and_missing_ones_are_zero(tmp_path):
    group = cgroup.create("g", 1 << 30, _root(tmp_path))
    (group / "memory.max_usage_in_bytes").write_text("2621440000\n")
    (group / "memory.failcnt").write_text("1234\n")
    (group / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert cgroup.stats(group) == {"max_usage_bytes": 2621440000, "failcnt": 1234, "oom_kill": 1}
    (group / "memory.memsw.failcnt").write_text("1300\n")  # swap accounted: its counter is the one hit
    assert cgroup.stats(group)["failcnt"] == 1300
    bare = cgroup.create("old-kernel", 1 << 30, tmp_path / "memory")
    (bare / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\n")
    assert cgroup.stats(bare) == {"max_usage_bytes": 0, "failcnt": 0, "oom_kill": 0}


def test_groups_are_removed_when_the_run_fails(tmp_path):
    root = _root(tmp_path)
    with pytest.raises(RuntimeError), cgroup.groups("rdkeras-bench-7", 4, 1 << 30, root) as made:
        assert [g.name for g in made] == [f"rdkeras-bench-7-{r}" for r in range(4)]
        raise RuntimeError("a worker failed")
    assert sorted(p.name for p in root.iterdir()) == ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]


def test_a_group_that_cannot_be_made_leaves_none_behind_and_removing_twice_is_fine(tmp_path):
    root = _root(tmp_path)
    (root / "rdkeras-bench-7-1").mkdir()  # taken: the second group cannot be made
    with pytest.raises(FileExistsError), cgroup.groups("rdkeras-bench-7", 2, 1 << 30, root):
        pass
    assert not (root / "rdkeras-bench-7-0").exists()
    cgroup.remove(root / "rdkeras-bench-7-0")  # gone already: nothing to do


def test_the_capped_bench_says_why_and_passes_where_caps_cannot_be_set(tmp_path, monkeypatch, capsys):
    from rdkeras.bench import memory, memory_cap

    monkeypatch.setattr(cgroup, "ROOT", tmp_path / "not-mounted")
    parser = argparse.ArgumentParser()
    memory.add_arguments(parser)
    assert memory.run(parser.parse_args(["--oom-demo", "--out", str(tmp_path)])) == 0
    assert "per-process caps skipped: no cgroup v1 memory controller" in capsys.readouterr().out
    assert memory_cap.DEMO["cap_mb"] > 0
