"""The scale model at scale: Horovod's published cluster and the seed's testbed, projected from cited constants
alone (docs/scale-model.md)."""

from __future__ import annotations

from rdkeras.bench.clusters import LABELS
from rdkeras.bench.figures.common import Section, Target, markdown_table
from rdkeras.bench.scale_model import PART_LABELS


def _pct(v: float) -> str:
    return f"{v * 100:.0f}%"


def _spent(parts: dict[str, float], top: int = 3) -> str:
    """The largest parts of a step's communication: 'bytes through the servers' NICs 351 ms, ...'."""
    biggest = sorted((k for k in parts if parts[k] > 0), key=lambda k: -parts[k])[:top]
    return ", ".join(f"{PART_LABELS[k]} {parts[k] * 1e3:.0f} ms" for k in biggest)


def _at_scale_models(at: dict) -> list[str]:
    lines = [
        "## Scale model at scale: Horovod's published cluster and the seed's testbed",
        "",
        "No calibration from this machine: every constant is cited in rdkeras/bench/clusters.py and "
        "rdkeras/bench/cluster_model.py. The models are keras.applications' at ImageNet size, their forward FLOPs and "
        "gradients counted here; each computes at the share of a P100's peak TensorFlow's tf_cnn_benchmarks "
        "measured for it on one P100 (DGX-1, May 2017; ResNet-101 between ResNet-50 and ResNet-152 by FLOPs), "
        "forward + backward = 3 × forward, backprop's gradients appearing in the order and at the times its layers' "
        "FLOPs say. rdkeras's gradients travel GPU → host → GPU through its numpy_function hops: each bucket is "
        "copied off the GPU as backprop produces it and back once its exchange is done, the last bucket's after "
        "everything (PCIe at 12 GB/s) — charged until a path without host staging exists.",
        "",
    ]
    header = ["model", "image", "forward GFLOPs/image", "gradients", "P100 share of peak, batch 64 / 32"]
    rows = [
        [
            LABELS.get(name, name),
            f"{m['image_size']}²",
            f"{m['forward_flops'] / 1e9:.2f}",
            f"{m['gradient_bytes'] / 1e6:.0f} MB in {m['tensor_count']} tensors",
            f"{_pct(m['share']['64'])} / {_pct(m['share']['32'])}",
        ]
        for name, m in at["models"].items()
    ]
    return [*lines, *markdown_table(header, rows)]


def _horovod(at: dict) -> list[str]:
    hv = at["clusters"]["horovod"]
    lines = [
        "",
        f"Horovod's benchmark (horovod docs/benchmarks.rst): servers of {hv['gpus_per_server']} Pascal GPUs, "
        f"{hv['link_gbps']:g} Gbit/s RoCE, batch 64 per GPU, tf_cnn_benchmarks. Predicted: one flat NCCL ring "
        "across every GPU, server by server (each server's NIC carries one ring edge each way), priced by NVIDIA's "
        "own NCCL cost model (per-step latencies inside a server and across, ×1.9 for large rings across nodes; "
        "bandwidth: the NIC's), sums on the GPU; Horovod's tensor fusion (64 MB) sends whatever gradients exist "
        "whenever the previous allreduce ends, so the exchange overlaps backprop. GPUs taken as the P100 the models' "
        "speed was measured on (SXM2, 10.6 TFLOP/s); with PCIe P100s (9.3) each step computes 14% longer.",
        "",
    ]
    header = [
        "GPUs",
        "model",
        "compute/step",
        "predicted",
        "Horovod published",
        "difference",
        "exchange after backprop",
        "with PCIe P100s",
        "what the exchange spends (hidden or not)",
    ]
    rows = [
        [
            f"{r['gpus']} ({r['servers']} × {hv['gpus_per_server']})",
            LABELS.get(r["model"], r["model"]),
            f"{r['compute_s'] * 1e3:.0f} ms",
            _pct(r["efficiency"]),
            _pct(r["published"]),
            f"{(r['efficiency'] - r['published']) * 100:+.0f} points",
            _pct(r["no_overlap"]),
            _pct(r["pcie_p100"]),
            f"{_spent(r['parts'])} ({sum(r['calls'].values())} allreduces)",
        ]
        for r in at["horovod"]
    ]
    return [*lines, *markdown_table(header, rows)]


def _auto(at: dict) -> list[str]:
    if not at.get("auto"):
        return []
    gpus = at["auto"][0]["gpus"]
    lines = [
        "",
        f"rdkeras on Horovod's cluster ({gpus} GPUs): `auto` (hierarchical here: a shared-memory ring inside "
        "each server, the servers' NIC shared by their 4 cross-server rings, recursive doubling where it "
        "costs less), 4 MiB buckets overlapping backprop, one bucket at a time, sums on a CPU core; with "
        'compression="bf16" (half the bytes between servers); the flat ring; and `auto` were there no host staging:',
        "",
    ]
    header = [
        "model",
        "auto",
        "auto, bf16",
        "ring",
        "auto without host staging",
        "Horovod published",
        "what auto's exchange spends (hidden or not)",
    ]
    rows = [
        [
            LABELS.get(r["model"], r["model"]),
            _pct(r["efficiency"]),
            _pct(r["bf16"]["efficiency"]),
            _pct(r["ring"]),
            _pct(r["no_staging"]),
            _pct(r["published"]),
            _spent(r["parts"], 4),
        ]
        for r in at["auto"]
    ]
    return [*lines, *markdown_table(header, rows)]


def _seed(at: dict) -> list[str]:
    if not at.get("seed"):
        return []
    sizes = [s["workers"] for s in at["seed"][0]["sizes"]]
    lines = [
        "",
        "rdkeras `auto` on the seed's testbed (one P100 and one 100 Gb/s NIC a server, so a 2D ring of √N-ish "
        "groups where N has a divisor, else the flat ring, or recursive doubling where it costs less), batch 32: "
        "per-worker mini-batches/s, and against "
        f"{sizes[0]} workers':",
        "",
    ]
    header = [
        "model",
        *(f"{n} workers" for n in sizes),
        f"{sizes[-1]} ÷ {sizes[0]}",
        f"what the exchange spends at {sizes[-1]} (hidden or not)",
    ]
    rows = [
        [
            LABELS.get(r["model"], r["model"]),
            *(f"{s['rate']:.2f}" for s in r["sizes"]),
            _pct(r["sizes"][-1]["vs_first"]),
            _spent(r["sizes"][-1]["parts"], 4),
        ]
        for r in at["seed"]
    ]
    return [*lines, *markdown_table(header, rows), ""]


def _at_scale_targets(at: dict) -> list[Target]:
    """Horovod's table within 10 points (flat ring, 512 GPUs); auto at or above it; the seed's testbed at 1024."""
    targets = []
    ring = [r for r in at["horovod"] if r["gpus"] == max(x["gpus"] for x in at["horovod"])]
    if ring:
        worst = max(ring, key=lambda r: abs(r["efficiency"] - r["published"]))
        off = abs(worst["efficiency"] - worst["published"])
        targets.append(
            Target(
                f"scale model's flat NCCL ring within 10 points of Horovod's published efficiency at {ring[0]['gpus']} "
                "GPUs",
                off <= 0.10,
                ", ".join(
                    f"{LABELS.get(r['model'], r['model'])} {_pct(r['efficiency'])} vs {_pct(r['published'])}"
                    for r in ring
                ),
                [
                    f"{LABELS.get(r['model'], r['model'])}: {(r['efficiency'] - r['published']) * 100:+.0f} points; "
                    f"the exchange spends {_spent(r['parts'])}"
                    for r in ring
                    if abs(r["efficiency"] - r["published"]) > 0.10
                ],
            )
        )
    if at.get("auto"):
        below = [r for r in at["auto"] if r["efficiency"] < r["published"]]
        targets.append(
            Target(
                f"rdkeras auto on Horovod's cluster at or above Horovod's figures ({at['auto'][0]['gpus']} GPUs)",
                not below,
                ", ".join(
                    f"{LABELS.get(r['model'], r['model'])} {_pct(r['efficiency'])} vs {_pct(r['published'])} "
                    f"(bf16: {_pct(r['bf16']['efficiency'])})"
                    for r in at["auto"]
                ),
                [
                    f"{LABELS.get(r['model'], r['model'])}: step {r['step_s'] * 1e3:.0f} ms for "
                    f"{r['compute_s'] * 1e3:.0f} ms of compute; its exchange spends {_spent(r['parts'], 5)} "
                    "(NCCL's sums and copies run on the GPU); without host staging "
                    f"{_pct(r['no_staging'])}, with bf16 {_pct(r['bf16']['efficiency'])}"
                    for r in below
                ],
            )
        )
    if at.get("seed"):
        low = [r for r in at["seed"] if r["sizes"][-1]["vs_first"] < 0.80]
        first, last = at["seed"][0]["sizes"][0]["workers"], at["seed"][0]["sizes"][-1]["workers"]
        targets.append(
            Target(
                f"seed's testbed: per-worker throughput at {last} workers ≥ 80% of {first} workers' (VGG-16, "
                "Inception V3)",
                not low,
                ", ".join(
                    f"{LABELS.get(r['model'], r['model'])} {_pct(r['sizes'][-1]['vs_first'])}" for r in at["seed"]
                ),
                [
                    f"{LABELS.get(r['model'], r['model'])}: at {last} workers the exchange spends "
                    f"{_spent(r['sizes'][-1]['parts'], 4)} (at {first}: {_spent(r['sizes'][0]['parts'], 4)}); "
                    f"{sum(r['sizes'][-1]['calls'].values())} allreduces a step "
                    f"({', '.join(f'{k}: {v}' for k, v in r['sizes'][-1]['calls'].items())}), each step of them a "
                    f"message latency: {r['sizes'][-1]['parts']['latency'] * 1e3:.0f} ms a step"
                    for r in low
                ],
            )
        )
    return targets


def at_scale(at: dict) -> Section:
    """The at-scale section: the models, Horovod's table against the flat ring, auto there, the seed's testbed."""
    return _at_scale_models(at) + _horovod(at) + _auto(at) + _seed(at), _at_scale_targets(at)
