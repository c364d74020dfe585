"""The wheel carries the top-level conf/ and recipes/ (and the shipped digits), and the app finds them there from any
directory."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from rdkeras import _engine
from tests.conftest import TESTS_DIR

REPO = TESTS_DIR.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built without CMake (the layout is what is under test, not the extension)."""
    out = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q"]
    done = subprocess.run(
        [*pip, "-C", "wheel.cmake=false", "-w", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (built,) = out.glob("rdkeras-*.whl")
    return built


def test_the_wheel_holds_every_config_group_and_recipe(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"rdkeras/conf/{p.relative_to(REPO / 'conf')}" for p in (REPO / "conf").rglob("*.yaml")}
    expected |= {f"rdkeras/recipes/{p.name}" for p in (REPO / "recipes").glob("*.yaml")}
    assert "rdkeras/conf/train.yaml" in expected and "rdkeras/recipes/fcn5.yaml" in expected
    expected.add("rdkeras/data/digits.csv.gz")  # the default recipe's data, inside the package
    assert expected <= names, sorted(expected - names)


def test_the_installed_layout_runs_a_recipe_from_another_directory(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    shutil.copy(_engine.__file__, site / "rdkeras")  # the extension this checkout built
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # -S: no .pth files, so the editable install's import hook cannot serve this checkout instead.
    prelude = f"import sys; sys.path[:0] = [{str(site)!r}, {sysconfig.get_paths()['purelib']!r}]; "
    code = prelude + (
        "from rdkeras.train.config import config_dirs, compose; print(*config_dirs()); "
        "print(compose(['+recipe=fcn5']).trainer.steps_per_epoch)"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120, cwd=elsewhere
    )
    assert done.returncode == 0, done.stderr[-3000:]
    dirs, steps = done.stdout.split("\n")[:2]
    assert dirs == f"{site / 'rdkeras' / 'conf'} {site / 'rdkeras' / 'recipes'}"
    assert steps == "50"
    # The command line, as a user types it (--cfg job prints the composed job config and stops).
    cli = prelude + "import runpy; sys.argv = ['rdkeras.train', '+recipe=vgg16_model', '--cfg', 'job']; "
    cli += "runpy.run_module('rdkeras.train', run_name='__main__')"
    done = subprocess.run([sys.executable, "-S", "-c", cli], capture_output=True, text=True, timeout=120, cwd=elsewhere)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "parallelism: model" in done.stdout and "block*: 0" in done.stdout, done.stdout
