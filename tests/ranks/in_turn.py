"""Several tests' workloads in one set of rank processes, one after another (tests.conftest.launch_in_turn):
each process imports TensorFlow once, not once per test."""

from __future__ import annotations

import importlib
import os
import sys
import traceback


def run(jobs: list[dict]) -> dict:
    """Runs each job's ``target`` ("module:function") with its kwargs and its variables (its own rendezvous
    port, maybe a transport) set; returns {key: {"value": what it returned} or {"error": its traceback}}.

    A job that raises ends the launch on this rank (the other ranks may be waiting for it in that job: its
    exit tells them); the jobs before it keep their results.
    """
    out: dict = {}
    for job in jobs:
        saved = {name: os.environ.get(name) for name in job["env"]}
        os.environ.update(job["env"])
        module, name = job["target"].split(":")
        try:
            out[job["key"]] = {"value": getattr(importlib.import_module(module), name)(**job["kwargs"])}
        except BaseException:
            out[job["key"]] = {"error": traceback.format_exc()}
            return out
        finally:
            for var, value in saved.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value
            _fresh_keras()
    return out


def _fresh_keras() -> None:
    """What a new process would start the next job with: no models, layer names from scratch, float32."""
    if "keras" in sys.modules:
        import keras

        keras.backend.clear_session()
        keras.mixed_precision.set_global_policy("float32")
