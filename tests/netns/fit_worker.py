"""One worker of the two-host job: tests.multiproc.keras_workers.fit_model, its result written as JSON."""

import json
import os
import sys

from tests.multiproc.keras_workers import fit_model

out, batch = sys.argv[1], int(sys.argv[2])
result = fit_model(kind="mlp", batch=batch)
with open(os.path.join(out, f"rank-{os.environ['RDKERAS_RANK']}.json"), "w") as f:
    json.dump(result, f)
