"""One GPU per worker by local rank, with memory growth; checked against a fake device list."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from rdkeras import devices, options
from rdkeras.errors import EngineError


@dataclass(frozen=True)
class FakeDevice:
    name: str
    device_type: str = "GPU"


@dataclass
class FakeConfig:
    """The part of ``tf.config`` rdkeras.devices uses, recording what it was told."""

    count: int
    initialized: bool = False
    visible: list = field(default_factory=list)
    growth: list = field(default_factory=list)

    def __post_init__(self):
        self.experimental = self

    def list_physical_devices(self, kind):
        assert kind == "GPU"
        return [FakeDevice(f"/physical_device:GPU:{i}") for i in range(self.count)]

    def set_visible_devices(self, devs, kind):
        if self.initialized:
            raise RuntimeError("Visible devices cannot be modified after being initialized")
        self.visible = [d.name for d in devs]

    def set_memory_growth(self, dev, enable):
        self.growth.append((dev.name, enable))


@pytest.mark.parametrize(
    ("local_rank", "workers", "gpus", "expected"),
    [(0, 8, 8, (0,)), (5, 8, 8, (5,)), (3, 4, 2, (1,)), (1, 2, 1, (0,)), (0, 1, 0, ())],
)
def test_auto_uses_the_gpu_of_the_local_rank(local_rank, workers, gpus, expected):
    assert devices.choose(local_rank, workers, gpus) == expected


def test_overrides():
    assert devices.choose(3, 4, 4, "none") == ()
    assert devices.choose(3, 4, 4, "all") == (0, 1, 2, 3)
    assert devices.choose(0, 2, 4, "2,3") == (2, 3)
    with pytest.raises(EngineError, match=r"no GPU 4 here \(4 visible: 0..3\)"):
        devices.choose(0, 1, 4, "4")
    with pytest.raises(EngineError, match="RDKERAS_GPU must be auto, all, none"):
        devices.choose(0, 1, 4, "first")


def test_each_worker_sees_only_its_gpu_with_memory_growth():
    for rank in range(4):
        tf = FakeConfig(4)
        choice = devices.use_local_gpu(rank, 4, settings=options.from_env({}), tf_config=tf)
        assert tf.visible == [f"/physical_device:GPU:{rank}"]
        assert tf.growth == [(f"/physical_device:GPU:{rank}", True)]
        assert choice.describe() == f"GPU:{rank} of 4, memory growth"


def test_the_local_rank_comes_from_the_cluster(monkeypatch):
    for name, value in {
        "RDKERAS_RANK": "2",
        "RDKERAS_WORLD_SIZE": "4",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "4",
    }.items():
        monkeypatch.setenv(name, value)
    tf = FakeConfig(4)
    assert devices.use_local_gpu(settings=options.from_env({}), tf_config=tf).describe() == "GPU:2 of 4, memory growth"


def test_memory_growth_can_be_turned_off_and_gpus_hidden():
    tf = FakeConfig(2)
    choice = devices.use_local_gpu(1, 2, settings=options.from_env({"RDKERAS_GPU_MEMORY_GROWTH": "0"}), tf_config=tf)
    assert tf.visible == ["/physical_device:GPU:1"] and tf.growth == []
    assert choice.describe() == "GPU:1 of 2"
    tf = FakeConfig(2)
    choice = devices.use_local_gpu(0, 2, settings=options.from_env({"RDKERAS_GPU": "none"}), tf_config=tf)
    assert tf.visible == [] and choice.describe() == "CPU (RDKERAS_GPU=none; 2 GPU(s) hidden)"


def test_no_gpu_means_cpu_and_nothing_is_touched():
    tf = FakeConfig(0)
    choice = devices.use_local_gpu(1, 2, settings=options.from_env({}), tf_config=tf)
    assert choice.gpus == () and choice.describe() == "CPU" and tf.visible == []


def test_too_late_is_reported_not_raised():
    tf = FakeConfig(2, initialized=True)
    choice = devices.use_local_gpu(0, 2, settings=options.from_env({}), tf_config=tf)
    assert "not applied: TensorFlow had initialized its devices" in choice.describe()


def test_the_real_tensorflow_on_this_machine():
    import tensorflow as tf

    choice = devices.use_local_gpu(0, 1, settings=options.from_env({}))
    assert choice.visible == len(tf.config.list_physical_devices("GPU"))


def test_doctor_lists_the_gpus_and_each_local_ranks_choice():
    import tensorflow as tf

    from rdkeras import doctor

    lines = doctor.gpu_lines(local_world_size=2)
    count = len(tf.config.list_physical_devices("GPU"))
    if count == 0:
        assert lines[0].startswith("none visible to TensorFlow") and len(lines) == 1
    else:
        assert sum(line.startswith("GPU:") for line in lines) == count
        assert f"local rank 1 uses GPU:{1 % count}" in lines[-1]
