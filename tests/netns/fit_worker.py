"""One worker of the two-host job: tests.ranks.keras_workers' fit, its result (and what went over
which link) written as JSON; with a third argument "reference", rank 0 then trains the same model in one
plain Keras process (the same global batch) too."""

import json
import os
import sys

import rdkeras
from tests.ranks.keras_workers import _fit_model_with

out, batch = sys.argv[1], int(sys.argv[2])
strategy = rdkeras.RDMAStrategy()
result = _fit_model_with(strategy, "mlp", batch)
result.update(rank=strategy.worker_index, traffic=strategy.engine.traffic(), plan_text=strategy.plan_text())
strategy.close()
if sys.argv[3:] == ["reference"] and result["rank"] == 0:
    result["reference"] = _fit_model_with(None, "mlp", batch)["weights"]
with open(os.path.join(out, f"rank-{os.environ['RDKERAS_RANK']}.json"), "w") as f:
    json.dump(result, f)
