"""Composing and checking the training config (no TensorFlow needed here)."""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

from rdkeras import cluster
from rdkeras._log import logger
from rdkeras.engine import TRANSPORTS
from rdkeras.options import keras_backend
from rdkeras.parallel import canonical, check_settings, is_auto
from rdkeras.train import values

CONFIG_NAME = "train"
GROUPS = ("model", "data", "parallel", "transport", "cluster", "trainer", "logger", "callbacks")
# Keys renamed to RDMAStrategy's own words (old -> new); the old ones still work, with a warning.
RENAMED_KEYS = {"parallel.kind": "parallel.parallelism", "parallel.num_stages": "parallel.stages"}


class ConfigError(ValueError):
    """The configuration cannot work; the message says what is wrong and what to do."""


def config_dirs() -> tuple[Path, Path]:
    """The config groups folder and the recipes folder: ``conf/`` and ``recipes/``.

    A wheel ships them inside the package (``rdkeras/conf``, ``rdkeras/recipes``);
    a source checkout (and so ``pip install -e .``) has them at its top level,
    where they are read live.
    """
    package = Path(__file__).resolve().parent.parent
    for base in (package, package.parent):
        conf, recipes_dir = base / "conf", base / "recipes"
        if (conf / f"{CONFIG_NAME}.yaml").is_file() and recipes_dir.is_dir():
            return conf, recipes_dir
    raise ConfigError(f"no conf/ and recipes/ next to or inside {package}: reinstall rdkeras (pip install .)")


def recipe_file(name: str) -> Path:
    return config_dirs()[1] / f"{name}.yaml"


def options(group: str) -> list[str]:
    """The options of a config group (or ``recipe``)."""
    conf, recipes_dir = config_dirs()
    folder = recipes_dir if group == "recipe" else conf / group
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def recipes() -> list[str]:
    return options("recipe")


def hydra_sources() -> str:
    """Registers the recipes folder as Hydra's ``recipe`` group; returns the primary config folder."""
    from hydra.core.plugins import Plugins

    from rdkeras.train import _hydra_recipes

    Plugins.instance().register(_hydra_recipes.RecipesSource)
    Plugins.instance().register(_hydra_recipes.RecipesSearchPath)
    return str(config_dirs()[0])


def compose(overrides: list[str] | None = None) -> Any:
    """The composed config for these command-line overrides, as the app would see it (for tests and notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(hydra_sources(), version_base=None):
        return hydra_compose(CONFIG_NAME, overrides=rename_overrides(list(overrides or [])))


def unknown_key(key: str) -> str:
    """The message for an override of a key no config has: the closest keys there are (Hydra's own advice, to
    add it with ``+``, would add a key nothing reads)."""
    import difflib

    from omegaconf import OmegaConf

    try:
        known = list(_flat_keys(OmegaConf.to_container(compose([]))))
    except Exception:  # the suggestion is a courtesy; the error stands without it
        known = []
    parent, _, last = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == parent}
    if parent in known or not parent:  # a typo in the last word: compare it with its siblings'
        close = [siblings[w] for w in difflib.get_close_matches(last, list(siblings), n=3, cutoff=0.75)]
    else:
        close = difflib.get_close_matches(key, known, n=3, cutoff=0.75)
    if not close:  # the right word in the wrong place (epochs=3 for trainer.epochs=3)
        close = [k for k in known if k.rpartition(".")[2] == last][:3]
    hint = f"did you mean {' or '.join(close)}?" if close else "see the keys with --cfg job"
    return f"unknown config key {key!r}: {hint} (a key of your own that something reads: +{key}=VALUE)"


def _flat_keys(node: Any, prefix: str = "") -> list[str]:
    out: list[str] = []
    for key, value in node.items():
        out.append(f"{prefix}{key}")
        if isinstance(value, dict):
            out += _flat_keys(value, f"{prefix}{key}.")
    return out


def _renamed(old: str) -> str:
    new = RENAMED_KEYS[old]
    logger.warning("%s is renamed %s (RDMAStrategy's word); the old key still works for now", old, new)
    return new


def rename_overrides(overrides: list[str]) -> list[str]:
    """Command-line overrides with the renamed keys (RENAMED_KEYS) in their new words, ``+recipe=NAME`` (how
    the recipe was chosen before train.yaml had a recipe slot, and still in Hydra habit) as ``recipe=NAME``, and
    ``recipe=null`` (no recipe: the default groups alone) as Hydra's ``~recipe``."""
    out = []
    for o in overrides:
        prefix = o[: len(o) - len(o.lstrip("+~"))]
        key, sep, value = o[len(prefix) :].partition("=")
        if key == "recipe" and sep and value.lower() in ("null", "none") and prefix in ("", "+", "++"):
            out.append("~recipe")
        elif key == "recipe" and prefix in ("+", "++") and sep:
            out.append(f"recipe={value}")
        else:
            out.append(f"{prefix}{_renamed(key)}{sep}{value}" if key in RENAMED_KEYS else o)
    return out


def rename_keys(cfg: Any) -> None:
    """Moves renamed keys a config file still sets (a recipe of one's own) to their new names, in place."""
    from omegaconf import open_dict

    for old in RENAMED_KEYS:
        group, _, key = old.partition(".")
        node = cfg.get(group)
        if node is None or key not in node:
            continue
        new_key = _renamed(old).partition(".")[2]
        with open_dict(node):
            node[new_key] = node.pop(key)


def validate(cfg: Any) -> None:
    """Checks what can be checked before any worker starts; raises ConfigError."""
    rename_keys(cfg)
    backend = keras_backend()
    if backend != "tensorflow":
        raise ConfigError(
            f"rdkeras runs Keras on the TensorFlow backend, but Keras is set to {backend!r} (KERAS_BACKEND or "
            "~/.keras/keras.json): set KERAS_BACKEND=tensorflow to train with rdkeras"
        )
    kind = cfg.cluster.kind
    if kind not in ("local", "env"):
        raise ConfigError(f"cluster.kind must be 'local' or 'env', got {kind!r}")
    check_values(cfg)
    if cfg.transport.name not in TRANSPORTS:
        raise ConfigError(f"transport.name must be one of {', '.join(TRANSPORTS)}; got {cfg.transport.name!r}")
    parallel = cfg.parallel
    try:
        from omegaconf import OmegaConf

        flat = OmegaConf.to_container(parallel, resolve=True)
        settings = {str(k): v for k, v in flat.items() if k != "_target_"}  # type: ignore[union-attr]
        check_settings(
            workers=cfg.cluster.num_workers if kind == "local" and not cluster.in_job() else None, **settings
        )
    except ValueError as e:
        raise ConfigError(f"parallel: {e}") from None
    if parallel.get("shard") == "parameters":
        saving = [name for name, spec in (cfg.get("callbacks") or {}).items()
                  if str(spec.get("_target_", "")).endswith(("ModelCheckpoint", "BackupAndRestore"))]  # fmt: skip
        if saving:
            raise ConfigError(
                f"parallel.shard=parameters: callbacks {', '.join(saving)} write Keras files, which workers holding "
                "1/N of the weights each cannot write yet: leave them out with 'callbacks=[]'"
            )
    trainer = cfg.trainer
    for flag in ("resume", "shuffle"):
        if not isinstance(trainer.get(flag), bool):
            raise ConfigError(f"trainer.{flag} must be true or false, got {trainer.get(flag)!r}")
    # (in a job, its size counts)
    if kind == "local" and canonical(parallel.parallelism) != "model" and not cluster.in_job():
        replicas = cfg.cluster.num_workers
        if parallel.parallelism == "hybrid" and (parallel.get("stages") or not is_auto(parallel.placement)):
            replicas //= max(1, parallel.get("stages") or max(parallel.placement.values()) + 1)
        if replicas > 1 and trainer.batch_size % replicas:
            raise ConfigError(
                f"trainer.batch_size={trainer.batch_size} is the global batch, split over {replicas} replicas, "
                f"and does not divide by {replicas}: choose a multiple of {replicas}"
            )
    if "samples" in cfg.data and cfg.data.samples is None and trainer.steps_per_epoch is None:
        raise ConfigError("synthetic data is sized by trainer.steps_per_epoch: set it (or data.samples)")
    _check_objective(trainer)
    arguments = remat_arguments(trainer.get("remat"))
    if arguments is not None and arguments["mode"] == "list_of_layers" and not arguments["layer_names"]:
        raise ConfigError("trainer.remat.mode=list_of_layers recomputes the layers trainer.remat.layer_names names: "
                          "name them (e.g. 'trainer.remat.layer_names=[dense_1,dense_2]')")  # fmt: skip


def remat_arguments(setting: Any) -> dict[str, Any] | None:
    """``keras.RematScope``'s arguments from ``trainer.remat`` (a mapping, or a mode alone); None: no
    rematerialization (null, or mode null or "none")."""
    if isinstance(setting, str) or setting is None:
        setting = {"mode": setting}
    mode = setting.get("mode")
    if mode in (None, "none"):
        return None
    threshold = setting.get("output_size_threshold")
    return {"mode": mode, "output_size_threshold": 1024 if threshold is None else threshold,
            "layer_names": list(setting.get("layer_names") or [])}  # fmt: skip


def check_values(cfg: Any) -> None:
    """The config's numbers against :data:`rdkeras.train.values.RULES` (a table of setting -> rule)."""
    from omegaconf import OmegaConf

    settings: Any = OmegaConf.to_container(cfg, resolve=True)
    try:
        values.check(settings)
    except values.SettingError as e:
        raise ConfigError(str(e)) from None


def _check_objective(trainer: Any) -> None:
    """trainer.objective must be a key the epoch logs will hold: the loss, a metric named by a string, their
    val_ forms, or a language model's perplexity (the run itself checks the rest, at its end)."""
    objective = str(trainer.get("objective", "loss"))
    named = ["loss", "perplexity", *(m for m in trainer.get("metrics", []) if isinstance(m, str))]
    if all(isinstance(m, str) for m in trainer.get("metrics", [])) and objective.removeprefix("val_") not in named:
        choices = ", ".join([*named, *(f"val_{k}" for k in named)])
        raise ConfigError(
            f"trainer.objective={objective!r} is not among the logs this run writes; choose one of: {choices}"
        )


def check_placement(placement: dict, model: Any) -> None:
    """Every placement glob must name at least one of the model's layers."""
    names = [layer.name for layer in model.layers]
    for pattern in placement:
        if not fnmatch.filter(names, pattern):
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise ConfigError(
                f"parallel.placement pattern {pattern!r} matches no layer of model {model.name!r} (layers: {shown})"
            )
