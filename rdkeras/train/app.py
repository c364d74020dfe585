"""The Hydra entry point: compose, check, then spawn local workers or run as one worker."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from rdkeras import cluster
from rdkeras.train.config import CONFIG_NAME, ConfigError, hydra_sources, rename_overrides, unknown_key, validate
from rdkeras.train.divergence import DivergedError

PROG = "rdkeras.train"
RESOLVED_CONFIG = "resolved_config.yaml"
# A worker that stops on a bad config prints this prefix and exits with this code.
ERROR_PREFIX = f"{PROG}: error: "
CONFIG_EXIT = 2


# Errors of the jobs run by this process (one, or one per --multirun job), kept here rather than
# raised through Hydra, which would add its own "Error executing job" report.
_job_errors: list[BaseException] = []


def _task(cfg: Any) -> float | None:
    """One job; returns ``trainer.objective`` of its final epoch (what Optuna/Ax sweepers optimise)."""
    from omegaconf.errors import OmegaConfBaseException

    from rdkeras.data import DataError

    try:
        return _run_job(cfg)
    except (ConfigError, DataError, OmegaConfBaseException, WorkerError, DivergedError) as e:
        _job_errors.append(e)
        from hydra.core.hydra_config import HydraConfig

        mode = HydraConfig.get().mode
        if mode is not None and mode.name == "MULTIRUN":
            print(f"{PROG}: job {HydraConfig.get().job.num} failed: {_describe(e)}", file=sys.stderr, flush=True)
            # The job must fail where it runs, so launcher plugins (submitit: another process, another
            # node) report it; Hydra's sweeper raises it again in this process once all jobs ran.
            raise
        return None


def _run_job(cfg: Any) -> float:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    validate(cfg)
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    # The config with every interpolation resolved: what the workers (and a reader, later) see.
    resolved = output_dir / RESOLVED_CONFIG
    OmegaConf.save(cfg, resolved, resolve=True)
    if cfg.cluster.kind == "local" and not cluster.in_job():
        spawn_local(resolved, output_dir, cfg.cluster.num_workers, cfg.cluster.timeout)
        results = json.loads((output_dir / "results.json").read_text())  # the chief's
        if cfg.trainer.get("compare_one_process") and cfg.cluster.num_workers > 1:
            results = compare_with_one_process(resolved, output_dir, cfg.cluster.timeout)
    else:
        from rdkeras.train import worker

        results = worker.run(OmegaConf.load(resolved), output_dir)
    return objective(results, cfg.trainer.objective)


def objective(results: dict, key: str) -> float:
    """The value of `key` in the final epoch's logs."""
    final = results.get("final", {})
    if key not in final:
        raise ConfigError(f"trainer.objective={key!r} is not among the final logs; choose one of: {', '.join(final)}")
    return float(final[key])


ONE_PROCESS_DIR = "one_process"


def compare_with_one_process(config_path: Path, output_dir: Path, timeout: float | None) -> dict:
    """The run's training again in one process, into ``one_process/`` (its callbacks and TensorBoard events there,
    so both runs pay the same per-step work); its throughput and final logs go into the run's results.json and
    a last summary line. Returns the results."""
    from omegaconf import OmegaConf

    from rdkeras.train import summary

    cfg = OmegaConf.load(config_path)
    cfg.cluster.num_workers, cfg.trainer.compare_one_process = 1, False
    folder = output_dir / ONE_PROCESS_DIR
    folder.mkdir(exist_ok=True)
    OmegaConf.save(cfg, folder / RESOLVED_CONFIG)
    print(f"{PROG}: the same training in one process, to compare (output in {folder})", flush=True)
    spawn_local(folder / RESOLVED_CONFIG, folder, 1, timeout, announce=False)
    alone = json.loads((folder / "results.json").read_text())
    results = json.loads((output_dir / "results.json").read_text())
    results["one_process"] = {k: alone[k] for k in ("examples_per_s", "final", "fit_seconds")}
    line = summary.one_process_line(results)
    results["summary"] += "\n" + line
    (output_dir / "results.json").write_text(json.dumps(results, indent=1))
    print(line, flush=True)
    return results


def spawn_local(
    config_path: Path, output_dir: Path, num_workers: int, timeout: float | None, announce: bool = True
) -> None:
    """Runs the workers on this machine through the launcher; their output is forwarded with a [rank] prefix
    (unless `announce` is false: then only into the logs) and written to ``worker-RANK.log`` in the output
    folder."""
    from rdkeras.launch import Job, _failure_message, failed_rank, run_local

    for stale in output_dir.glob("error-*.txt"):
        stale.unlink()
    command = [sys.executable, "-m", "rdkeras.train.worker", str(config_path), str(output_dir)]
    if announce:
        print(f"{PROG}: {num_workers} local workers, output in {output_dir}", flush=True)
    results = run_local(command, Job(num_workers), timeout=timeout, forward=announce, log_dir=output_dir)
    errors = {}
    for r in results:
        error_file = output_dir / f"error-{r.rank}.txt"
        errors[r.rank] = error_file.read_text() if error_file.exists() else ""
        error_file.unlink(missing_ok=True)
        with open(output_dir / f"worker-{r.rank}.log", "a") as log:
            log.write(errors[r.rank])
    bad = failed_rank(results)
    if bad is None:
        return
    if bad.returncode == CONFIG_EXIT and errors[bad.rank].startswith(ERROR_PREFIX):
        raise ConfigError(errors[bad.rank][len(ERROR_PREFIX) :].strip())
    # A diverged run: every worker stopped at the same step and said so (rdkeras.train.divergence).
    said = [errors[r.rank] for r in results if r.returncode == 1 and errors[r.rank].startswith(ERROR_PREFIX)]
    if said:
        raise DivergedError(said[0][len(ERROR_PREFIX) :].strip())
    raise WorkerError(_failure_message(bad, results) + f"\n(full logs: {output_dir}/worker-*.log)")


class WorkerError(RuntimeError):
    """A worker failed for a reason other than the config."""


def _describe(e: BaseException) -> str:
    """One line for a config error, whichever library raised it."""
    from hydra.errors import MissingConfigException

    if isinstance(e, MissingConfigException) and e.missing_cfg_file:
        group, _, name = e.missing_cfg_file.rpartition("/")
        if group:
            what = "recipe" if group == "recipe" else f"{group} option"
            return f"unknown {what} {name!r}; choose one of: {', '.join(e.options or [])} ({group}=NAME)"
    text = " ".join(str(e).split())
    typo = re.match(r"Could not override '([^']+)'\. To append to your config use \+", text)
    if typo:
        return unknown_key(typo.group(1))
    cause = e.__cause__
    if cause is not None and " ".join(str(cause).split()) not in text:
        text += f" ({' '.join(str(cause).split())})"
    return text


def main(argv: list[str] | None = None) -> int:
    """``python -m rdkeras.train``; returns the exit status (2 for a bad config, with one error line)."""
    from rdkeras._log import to_stderr

    to_stderr()  # an application: rdkeras's messages are shown
    import hydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from rdkeras.data import DataError

    args = rename_overrides(sys.argv[1:] if argv is None else list(argv))
    hydra_main = hydra.main(config_path=hydra_sources(), config_name=CONFIG_NAME, version_base=None)(_task)
    full_errors = os.environ.get("HYDRA_FULL_ERROR") == "1"
    saved_argv, saved_env = sys.argv, os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let errors reach us instead of Hydra's multi-line report
    sys.argv = [f"python -m {PROG}", *args]
    _job_errors.clear()
    try:
        hydra_main()
        if _job_errors:
            raise _job_errors[0]
    except (ConfigError, DataError, HydraException, OmegaConfBaseException) as e:
        if full_errors:
            raise
        print(ERROR_PREFIX + _describe(e), file=sys.stderr)
        return CONFIG_EXIT
    except DivergedError as e:
        print(ERROR_PREFIX + str(e), file=sys.stderr)
        return 1
    except WorkerError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        if not type(e).__module__.startswith("submitit"):
            raise
        # A job the cluster lost (killed, timed out, node failure): submitit says which and where its log is.
        print(f"{PROG}: a job failed on the cluster: {' '.join(str(e).split())[:2000]}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    finally:
        sys.argv = saved_argv
        if saved_env is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved_env
    return 0
