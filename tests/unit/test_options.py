"""Settings from the environment (rdkeras/options.py): read once, checked, each variable documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rdkeras import options

ROOT = Path(__file__).resolve().parents[2]


def test_every_variable_rdkeras_reads_is_in_the_table_and_the_other_way_round():
    documented = set(re.findall(r"``(RDKERAS_[A-Z_]+)``\s{2,}", options.__doc__ or ""))
    source = (ROOT / "rdkeras" / "options.py").read_text()
    read = set(re.findall(r'"(RDKERAS_[A-Z_]+)"', source))
    assert documented == read, documented ^ read


def test_defaults_and_values():
    assert options.from_env({}) == options.Options(
        cache_dir=options.from_env({}).cache_dir, config_dir=options.from_env({}).config_dir
    )
    s = options.from_env(
        {"RDKERAS_TRANSPORT": "tcp", "RDKERAS_TIMEOUT": "2.5", "RDKERAS_STORE": "launcher", "RDKERAS_DATA_MODE": "ps",
         "RDKERAS_GPU_MEMORY_GROWTH": "0", "RDKERAS_CACHE": "/c", "XDG_CONFIG_HOME": "/x"}
    )  # fmt: skip
    assert (s.transport, s.timeout, s.store, s.data_mode, s.gpu_memory_growth) == ("tcp", 2.5, "launcher", "ps", False)
    assert (s.cache_dir, s.config_dir) == (Path("/c"), Path("/x"))
    assert options.from_env({"RDKERAS_PROGRESS_TIMEOUT": "4.5"}).progress_timeout == 4.5
    assert options.from_env({"RDKERAS_PROGRESS_TIMEOUT": "0"}).progress_timeout == 0  # never


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RDKERAS_TIMEOUT": "0"}, r"RDKERAS_TIMEOUT='0': a wait needs a finite number of seconds > 0"),
        ({"RDKERAS_TIMEOUT": "nan"}, r"RDKERAS_TIMEOUT='nan': a wait needs a finite number"),
        ({"RDKERAS_TIMEOUT": "soon"}, r"RDKERAS_TIMEOUT='soon' is not a number of seconds"),
        ({"RDKERAS_PROGRESS_TIMEOUT": "-1"}, r"RDKERAS_PROGRESS_TIMEOUT='-1': a progress timeout is a finite"),
        ({"RDKERAS_PROGRESS_TIMEOUT": "inf"}, r"RDKERAS_PROGRESS_TIMEOUT='inf': a progress timeout is a finite"),
        ({"RDKERAS_STORE": "rank1"}, r"RDKERAS_STORE='rank1': choose rank0 or launcher"),
        ({"RDKERAS_DATA_MODE": "ring"}, r"RDKERAS_DATA_MODE='ring': choose allreduce or ps"),
        ({"RDKERAS_ARENA_BYTES": "1e9"}, r"RDKERAS_ARENA_BYTES='1e9' is not a whole number"),
    ],
)
def test_a_malformed_value_names_the_variable_and_what_it_takes(env, message):
    with pytest.raises(ValueError, match=message):
        options.from_env(env)


def test_an_explicit_timeout_is_checked_too():
    assert options.check_timeout(3) == 3.0
    with pytest.raises(ValueError, match=r"timeout=-1: a wait needs a finite number of seconds > 0"):
        options.check_timeout(-1)
