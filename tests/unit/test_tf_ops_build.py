"""Building rdkeras's TensorFlow ops library: cached by source and TensorFlow, opted out by environment."""

import pytest

from rdkeras import tf_ops


def test_the_library_is_built_once_then_taken_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RDKERAS_CACHE", str(tmp_path))
    first = tf_ops.build()
    assert first.parent == tmp_path / "ops" and first.suffix == ".so"
    stamp = first.stat().st_mtime_ns
    assert tf_ops.build() == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    assert sorted(p.name for p in (tmp_path / "ops").iterdir()) == sorted([first.name, first.with_suffix(".lock").name])


def test_a_failed_build_says_what_the_compiler_said(tmp_path, monkeypatch):
    monkeypatch.setenv("RDKERAS_CACHE", str(tmp_path))
    broken = tmp_path / "src"
    broken.mkdir()
    (broken / "rdma_ops.cc").write_text("this is not C++\n")
    (broken / "op_api.h").write_text("")
    monkeypatch.setattr(tf_ops, "source_dir", lambda: broken)
    with pytest.raises(RuntimeError, match=r"compiling .*rdma_ops\.cc failed"):
        tf_ops.build()
    assert not list(tmp_path.glob("ops/*.so"))  # nothing half-built left to be loaded


def test_native_ops_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("RDKERAS_NATIVE_OPS", "0")
    tf_ops.load.cache_clear()
    try:
        assert tf_ops.load() is None
    finally:
        tf_ops.load.cache_clear()
