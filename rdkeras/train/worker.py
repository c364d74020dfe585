"""One worker of a training job: data, model, strategy, callbacks, ``fit``.

Run by the app in-process (under TF_CONFIG, SLURM or the launcher) or, for
``cluster=local``, as ``python -m rdkeras.train.worker CONFIG OUTPUT_DIR`` in
each spawned worker, with the config the app resolved.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from rdkeras import cluster, options
from rdkeras.parallel import canonical, is_auto
from rdkeras.train import divergence
from rdkeras.train.config import ConfigError, check_placement, remat_arguments


def make_strategy(cfg: Any) -> Any:
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    import rdkeras

    try:
        # The parallel group names its own _target_: rdkeras.parallel.options.from_flat, which checks it.
        options = instantiate(cfg.parallel, _convert_="all")
        return rdkeras.RDMAStrategy(
            transport=None if cfg.transport.name == "auto" else cfg.transport.name,  # auto: RDKERAS_TRANSPORT wins
            timeout=cfg.transport.timeout,
            heartbeat_timeout=cfg.transport.get("heartbeat_timeout"),
            options=options,
        )
    except InstantiationException as e:
        raise ConfigError(f"parallel: {e.__cause__ or e}") from None
    except ValueError as e:  # what the strategy rejects for this job (placement and workers)
        raise ConfigError(str(e)) from None


def load_data(cfg: Any) -> Any:
    from hydra.utils import instantiate

    overrides = {}
    if "samples" in cfg.data and cfg.data.samples is None:
        # Synthetic data: exactly the epoch's worth of global batches (every worker makes the same
        # arrays and takes its part of each batch).
        overrides["samples"] = cfg.trainer.steps_per_epoch * cfg.trainer.batch_size
    return instantiate(cfg.data, **overrides)


def check_batch_size(batch_size: int, data: Any) -> None:
    """The global batch must not be larger than the training data (Keras would take the whole data as one
    smaller batch, and the run's throughput would count rows it never saw)."""
    rows = getattr(data.x, "shape", (None,))[0]
    if rows is not None and batch_size > rows:
        raise ConfigError(
            f"trainer.batch_size={batch_size} is more than the {rows:,} training examples of this data "
            f"({data.description}): choose at most {rows}"
        )


def _divergence_hint(cfg: Any) -> str:
    rate = cfg.trainer.optimizer.get("learning_rate")
    now = f" (now {rate})" if isinstance(rate, (int, float)) else ""
    return f"lower trainer.optimizer.learning_rate{now}, or look for nan or inf in the data"


def build_model(cfg: Any, data: Any) -> Any:
    from hydra.utils import instantiate

    # Sizes a model config leaves open (null) come from the data, e.g. a corpus's vocabulary.
    filled = {k: v for k, v in data.info.items() if k in cfg.model and cfg.model[k] is None}
    try:
        with remat_scope(cfg.trainer.get("remat")):
            return instantiate(cfg.model, **filled)
    except Exception as e:
        raise ConfigError(f"cannot build model {cfg.model._target_}: {e}") from None


def remat_scope(setting: Any) -> Any:
    """``keras.RematScope`` as ``trainer.remat`` says (a null context without it): Keras fixes each layer's mode when
    the layer is created, so the model is built under it, on every worker alike, and its calls recompute anywhere
    (a pipeline's stages too)."""
    import contextlib

    import keras

    arguments = remat_arguments(setting)
    return contextlib.nullcontext() if arguments is None else keras.RematScope(**arguments)


def perplexity_callback() -> Any:
    """Adds perplexity = exp(loss) to a language model's epoch logs (before TensorBoard and History see them)."""
    import keras

    class Perplexity(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            for key in ("loss", "val_loss"):
                if logs is not None and key in logs:
                    logs[key.replace("loss", "perplexity")] = math.exp(min(float(logs[key]), 50.0))

    return Perplexity()


# Arguments of the configured callbacks that name files: relative paths are inside the run folder.
PATH_ARGUMENTS = ("filepath", "backup_dir", "log_dir", "filename")


def configured_callbacks(cfg: Any, output_dir: Path) -> list[Any]:
    """The callbacks group (``callbacks.NAME: {_target_: ...}``), instantiated; BackupAndRestore only
    with ``trainer.resume``."""
    import keras
    from hydra.utils import instantiate

    out = []
    for name, spec in (cfg.get("callbacks") or {}).items():
        paths = {k: str(output_dir / spec[k]) for k in PATH_ARGUMENTS if isinstance(spec.get(k), str)}
        try:
            callback = instantiate(spec, **paths)
        except Exception as e:
            raise ConfigError(f"callbacks.{name}: cannot instantiate {spec.get('_target_')}: {e}") from None
        if not isinstance(callback, keras.callbacks.Callback):
            raise ConfigError(f"callbacks.{name}: {spec.get('_target_')} is not a keras.callbacks.Callback")
        if isinstance(callback, keras.callbacks.BackupAndRestore) and not cfg.trainer.resume:
            continue
        out.append(callback)
    return out


def write_hparams(log_dir: str, cfg: Any, validation: bool) -> None:
    """The run's settings as TensorBoard HParams, with its loss, metrics and objective as metric columns (the
    HPARAMS tab compares runs by them). Plumbing is left out: callbacks, ``_target_`` paths (a group's target
    becomes its name: ``model: fcn5``) and file paths."""
    import tensorflow as tf
    from omegaconf import OmegaConf
    from tensorboard.plugins.hparams import api as hp

    values = {k: v for k, v in _flat(OmegaConf.to_container(cfg, resolve=True)).items() if _is_setting(k)}
    for key in [k for k in values if k.endswith("._target_")]:
        values[key.removesuffix("._target_")] = str(values.pop(key)).rpartition(".")[2]
    keys = ["loss", *(m for m in cfg.trainer.metrics if isinstance(m, str))]
    keys += [f"val_{k}" for k in keys] if validation else []
    metrics = [
        hp.Metric(
            f"epoch_{k.removeprefix('val_')}",
            group="validation" if k.startswith("val_") else "train",
            display_name=f"{k} (objective)" if k == cfg.trainer.objective else k,
        )
        for k in keys
    ]
    with tf.summary.create_file_writer(log_dir).as_default():
        hp.hparams_config(hparams=[hp.HParam(k) for k in sorted(values)], metrics=metrics)
        hp.hparams(values, trial_id=Path(log_dir).parent.name)


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "."))
        else:
            out[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return out


def _is_setting(key: str) -> bool:
    """Whether a flattened config key is a setting worth a column (not the callbacks' or Hydra's plumbing, nor a
    file path)."""
    last = key.rpartition(".")[2]
    return not key.startswith(("callbacks.", "hydra.")) and not last.endswith(("path", "dir", "filepath"))


def plot_curves(history: dict, path: Path, title: str) -> None:
    """One panel per metric (training and validation together), per epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [k for k in history if not k.startswith("val_") and k != "learning_rate"]
    if not metrics:
        return
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.2), squeeze=False)
    for ax, name in zip(axes[0], metrics, strict=True):
        for key, label in ((name, "training"), (f"val_{name}", "validation")):
            if key in history:
                epochs = range(1, len(history[key]) + 1)
                ax.plot(epochs, history[key], marker="o", label=label)
        ax.set_title(name)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(cfg: Any, output_dir: str | Path) -> dict:
    """Trains as configured; the chief writes results.json into `output_dir`. Returns the results."""
    options.quiet_tensorflow_logs()
    output_dir = Path(output_dir)
    import keras
    import tensorflow as tf

    from rdkeras import devices
    from rdkeras.callbacks import TrainingStats
    from rdkeras.train import summary

    place = cluster.resolve()
    device = devices.use_local_gpu(place.local_rank, place.local_world_size)  # before TensorFlow picks its own
    threads = cfg.trainer.threads
    if threads is None and place.local_world_size > 1:  # the workers of one node share its cores
        threads = max(1, (os.cpu_count() or 1) // place.local_world_size)
    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    keras.utils.set_random_seed(cfg.trainer.seed)

    started = time.perf_counter()
    data = load_data(cfg)
    check_batch_size(cfg.trainer.batch_size, data)
    if canonical(cfg.parallel.parallelism) in ("model", "hybrid") and not is_auto(cfg.parallel.get("placement")):
        # A throwaway build names the layers, so a bad placement fails here with one clear line.
        check_placement(cfg.parallel.placement, build_model(cfg, data))
    strategy = make_strategy(cfg)
    try:
        chief = strategy.is_chief
        if chief:
            print(f"data: {data.description}", flush=True)
        with strategy.scope():
            model = build_model(cfg, data)
            optimizer_cfg = dict(cfg.trainer.optimizer)
            try:
                optimizer = keras.optimizers.get(
                    {"class_name": optimizer_cfg.pop("class_name"), "config": optimizer_cfg}
                )
            except (ValueError, TypeError) as e:
                raise ConfigError(f"trainer.optimizer: {e}") from None
            try:
                model.compile(
                    optimizer=optimizer, loss=cfg.trainer.loss, metrics=list(cfg.trainer.metrics), jit_compile=False
                )
            except ValueError as e:  # e.g. a placement the strategy rejects
                raise ConfigError(str(e)) from None
        if chief:
            print(
                f"model: {model.name}, {model.count_params():,} parameters; {strategy.num_workers} workers, "
                f"parallelism={cfg.parallel.parallelism}, transport={strategy.transport}",
                flush=True,
            )

        # First: a diverged run stops before any callback saves its epoch (rdkeras.train.divergence).
        callbacks: list[Any] = [divergence.stop_on_divergence(_divergence_hint(cfg))]
        if len(model.output.shape) == 3:  # a language model: per-token softmax
            callbacks.append(perplexity_callback())
        if cfg.logger.tensorboard:
            log_dir = str(output_dir / "tensorboard")
            profile = cfg.logger.get("profile_batch", 0)  # a step, or [first, last] (Keras takes a tuple)
            profile = profile if isinstance(profile, (int, str)) else tuple(profile)
            callbacks.append(
                keras.callbacks.TensorBoard(log_dir=log_dir, update_freq=cfg.logger.update_freq, profile_batch=profile)
            )
            callbacks.append(TrainingStats(log_dir, update_freq=cfg.logger.update_freq))
            if chief:
                write_hparams(log_dir, cfg, validation=data.validation is not None)
        callbacks += configured_callbacks(cfg, output_dir)

        timer = summary.step_timer()
        callbacks.append(timer)
        traffic_before = summary.measure(strategy)
        fit_started = time.perf_counter()
        history = model.fit(
            data.x,
            data.y,
            batch_size=cfg.trainer.batch_size,
            epochs=cfg.trainer.epochs,
            steps_per_epoch=cfg.trainer.steps_per_epoch,
            validation_data=data.validation,
            validation_steps=cfg.trainer.validation_steps,
            callbacks=callbacks,
            verbose=cfg.trainer.verbose,
            shuffle=cfg.trainer.shuffle,
        )
        fit_seconds = time.perf_counter() - fit_started
        changes = strategy.membership_changes
        # An elastic job's group changed engines, whose counters start afresh: no per-step traffic to report.
        traffic_after = {} if changes else summary.measure(strategy)
        results = {
            "model": model.name,
            "parameters": int(model.count_params()),
            "workers": strategy.num_workers,
            "parallelism": cfg.parallel.parallelism,
            "transport": strategy.transport,
            "data": data.description,
            "epochs": cfg.trainer.epochs,
            "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
            "fit_seconds": fit_seconds,
            "steps": len(history.epoch) * (cfg.trainer.steps_per_epoch or history.params.get("steps") or 0),
            "batch_size": cfg.trainer.batch_size,
            "device": device.describe(),
            **dict(zip(("steady_steps", "steady_seconds"), timer.steady(), strict=True)),
            "total_seconds": time.perf_counter() - started,
            "membership_changes": changes,
            "pipeline": pipeline_summary(strategy.plan) if strategy.parallelism != "data" else None,
        }
        final = {k: vs[-1] for k, vs in results["history"].items() if vs}
        results["final"] = final
        results["summary"] = summary.text(
            results,
            traffic_before,
            traffic_after,
            synthetic="samples" in cfg.data,
            compared=bool(cfg.trainer.get("compare_one_process")) and cfg.cluster.get("kind") == "local",
        )
        if strategy.is_chief:  # (in an elastic job, the chief of the group that finished)
            (output_dir / "results.json").write_text(json.dumps(results, indent=1))
            plot_curves(results["history"], output_dir / "curves.png", f"{model.name}, {strategy.num_workers} workers")
            shown = ", ".join(f"{k}={v:.4g}" for k, v in final.items())
            print(f"done in {fit_seconds:.1f} s: {shown}; results in {output_dir / 'results.json'}", flush=True)
            print(results["summary"], flush=True)
        return results
    finally:
        strategy.close()


def pipeline_summary(plan: Any) -> dict[str, Any] | None:
    """What a pipeline's plan says about its speed: each stage's layers, the automatic cut's measured costs and
    expected speed-up, the schedule and the micro-batches each stage stashes at most."""
    if plan is None:
        return None
    out: dict[str, Any] = {
        "stages": [plan.layers_of(s) for s in plan.stage_order],
        "micro_batches": plan.micro_batches,
        "schedule": plan.schedule,
        "stashed": [plan.stashed.get(s) for s in plan.stage_order],
    }
    if plan.partition is not None:
        out["compute_ms"] = [c * 1e3 for c in plan.partition.compute]
        out["expected_speedup"] = plan.partition.gpipe_speedup(plan.micro_batches)
        out["timed_rows"] = plan.partition.rows
    return out


def main(argv: list[str] | None = None) -> int:
    from omegaconf import OmegaConf

    from rdkeras.data import DataError
    from rdkeras.train.app import CONFIG_EXIT, ERROR_PREFIX

    config_path, output_dir = argv or sys.argv[1:3]
    try:
        run(OmegaConf.load(config_path), output_dir)
    except (ConfigError, DataError) as e:
        # Into a file, not stdout: the app reports it once, instead of once per worker.
        rank = cluster.resolve().rank
        Path(output_dir, f"error-{rank}.txt").write_text(ERROR_PREFIX + " ".join(str(e).split()) + "\n")
        return CONFIG_EXIT
    except divergence.DivergedError as e:  # every worker stops alike; the app reports the line once, exit status 1
        Path(output_dir, f"error-{cluster.resolve().rank}.txt").write_text(f"{ERROR_PREFIX}{e}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
