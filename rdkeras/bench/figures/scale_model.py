"""The scale model's part of the report: its calibration, its predictions of every run measured here, and
its projection to the seed's testbed and to larger clusters (docs/scale-model.md)."""

from __future__ import annotations

from pathlib import Path

from rdkeras.bench.clusters import LABELS
from rdkeras.bench.figures.common import Section, Target, fmt_x, pyplot, save_png, size_table, step_parts
from rdkeras.bench.labels import LABEL
from rdkeras.bench.scale_model import PART_LABELS


def _calibration(cal: dict) -> list[str]:
    """Each transport's per-message and per-byte cost, its exchange against one transfer, and what one
    collective cost beyond its transfers, by size."""
    lines = [
        "## Scale model",
        "",
        "Calibrated on this run's Send/Recv (per transport: the time of a transfer at each measured size, "
        "interpolated between them; summarised below as a per-message cost a and a per-byte cost b, which the "
        "projection uses), its exchange (both ways at once) and the Local runs' compute times; see "
        "docs/scale-model.md.",
        "",
        "| transport | a (per message) | 1/b (per byte) |",
        "|---|---|---|",
    ]
    for t, c in sorted(cal["transports"].items()):
        lines.append(f"| {LABEL.get(t, t)} | {c['latency_us']:.1f} µs | {c['GBps']:.2f} GB/s |")
    lines.append(f"| memcpy (reduction, assignment) | | {1 / cal['memcpy_per_byte'] / 1e9:.2f} GB/s |")
    exchanges = []
    for t, c in sorted(cal["transports"].items()):
        one, two = dict(c["points"]), dict(c.get("exchange_points", []))
        row = {x: f"{two[x] * 1e3:.2f} ms ({two[x] / one[x]:.2f}× one way)" for x in two if x in one}
        if row:
            exchanges.append(([LABEL.get(t, t)], row))
    lines += size_table(
        "What the predictions here use: an exchange, both ranks sending x bytes to each other at once (as in "
        "every ring step and parameter-server push or pull), against one transfer of x bytes:",
        ["transport"],
        exchanges,
    )
    beyond = [
        ([LABEL.get(t, t), "ring" if kind == "ring" else "PS"], {x: f"{y * 1e3:+.1f} ms" for x, y in points})
        for t, c in sorted(cal["transports"].items())
        for kind, points in c.get("beyond_transfers", {}).items()
    ]
    lines += size_table(
        "What one collective between two workers took beyond its transfers and sums (measured, minus what the "
        "exchange curve predicts for them: an RPC ring's concatenations and fresh arrays, the servers' copies); "
        "the predictions add it, interpolated by gradient bytes (never below 0):",
        ["transport", "collective"],
        beyond,
    )
    return lines + _compute(cal)


def _compute(cal: dict) -> list[str]:
    computes = {m: c for m, c in cal.get("compute_seconds", {}).items() if c.get("all_cores") and m != "probe"}
    if not computes:
        return []
    lines = [
        "",
        "Compute per step, one process alone and one per core at once (no communication). The predictions use "
        "the compute each distributed run's own processes measured undistributed before and after it (the "
        "validation's compute column), this table's second column where a run has none:",
        "",
        "| model | alone | every core at once | |",
        "|---|---|---|---|",
    ]
    for m, c in computes.items():
        alone, every = c["alone"], c["all_cores"]
        lines.append(f"| {m} | {alone * 1e3:.1f} ms | {every * 1e3:.1f} ms | {every / alone:.2f}× |")
    return lines


def _validation(validation: list[dict]) -> list[str]:
    if not validation:
        return []
    lines = [
        "",
        "Validation: every run measured here, predicted from the calibration alone.",
        "",
        "| model | mode | transport | workers | compute | measured s/step | predicted | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v in validation:
        compute = f"{v['compute_s'] * 1e3:.1f} ms" if v.get("compute_s") else "–"
        lines.append(
            f"| {v['model']} | {v['mode']} | {LABEL.get(v['transport'], v['transport'])} | {v['workers']} | "
            f"{compute} | {v['measured_s'] * 1e3:.1f} ms | {v['predicted_s'] * 1e3:.1f} ms | "
            f"{v['error'] * 100:+.0f}% |"
        )
    return lines


def _projection(sm: dict) -> list[str]:
    if not sm.get("projections"):
        return []
    tb = sm["testbed"]
    lines = [
        "",
        f"Projection to the seed's testbed: {tb['workers']} workers, {tb['gpu_tflops']} TFLOP/s GPUs at "
        f"{tb['gpu_efficiency'] * 100:.0f}% of peak, {tb['link_gbps']:g} Gb/s RDMA, TCP at {tb['tcp_gbps']:g} "
        f"Gb/s, {tb['memcpy_gb_per_s']:g} GB/s memcpy per core; the paper's model sizes. rdkeras pays the PCIe "
        f"copies of its numpy_function hops ({tb['pcie_gb_per_s']:g} GB/s): the gradients off the GPU with the "
        "exchange and the averages back after it, which overlap does not hide. Per-worker mini-batches/s, exchange "
        "after backprop (and overlapped):",
        "",
        "| model | mode | compute/step | rdkeras | RPC over RDMA | gRPC.TCP | rdkeras ÷ gRPC.TCP | "
        "rdkeras ÷ RPC over RDMA | seed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in sm["projections"]:
        r, o = p["rates"], p["rates_overlap"]
        seed = "up to 21× / about 2× (over the three models)" if p["model"] in ("vgg16", "lstm", "fcn5") else ""
        cells = " | ".join(f"{r[t]:.2f} ({o[t]:.2f})" if t in r else "–" for t in ("rdkeras", "rpc_rdma", "grpc_tcp"))
        xg = r["rdkeras"] / r["grpc_tcp"] if "grpc_tcp" in r else None
        xr = r["rdkeras"] / r["rpc_rdma"] if "rpc_rdma" in r else None
        lines.append(
            f"| {p['model']} | {p['mode']} | {p['compute_s'] * 1e3:.0f} ms | {cells} | {fmt_x(xg)} | "
            f"{fmt_x(xr, 2)} | {seed if p['mode'] == 'ps' else ''} |"
        )
    return lines


def _sweep(sweeps: dict | None) -> list[str]:
    if not sweeps:
        return []
    lines = [
        "",
        "Sweep (allreduce, exchange after backprop): per-worker mini-batches/s, rdkeras / RPC over RDMA / gRPC.TCP.",
        "",
        "| model | " + " | ".join(f"{r['workers']} workers" for r in next(iter(sweeps.values()))) + " |",
        "|---|" + "---|" * len(next(iter(sweeps.values()))),
    ]
    for m, rows in sweeps.items():
        cells = " | ".join(
            " / ".join(f"{r['rates'].get(t, float('nan')):.2f}" for t in ("rdkeras", "rpc_rdma", "grpc_tcp"))
            for r in rows
        )
        lines.append(f"| {m} | {cells} |")
    lines.append("")
    return lines


def tables(sm: dict) -> list[str]:
    """The scale model's section: calibration, compute, validation, projection and sweep tables."""
    return _calibration(sm["calibration"]) + _validation(sm["validation"]) + _projection(sm) + _sweep(sm.get("sweeps"))


def plot(sm: dict, path: Path) -> None:
    plt = pyplot()
    sweeps = sm.get("sweeps", {})
    fig, axes = plt.subplots(1, max(1, len(sweeps)), figsize=(4.2 * max(1, len(sweeps)), 3.8), squeeze=False)
    for ax, (m, rows) in zip(axes[0], sweeps.items(), strict=False):
        for t, label, color in (
            ("rdkeras", "rdkeras (RDMA)", "tab:blue"),
            ("rpc_rdma", "RPC over RDMA", "tab:purple"),
            ("grpc_tcp", "gRPC.TCP", "tab:red"),
        ):
            pts = [(r["workers"], r["rates"][t]) for r in rows if t in r["rates"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers (P100 + 100 Gb/s IB each)")
        ax.set_ylabel("mini-batches/s per worker")
        ax.set_title(f"{m} (paper size), allreduce, projected", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    save_png(fig, path)


def why_scale_model(validation: list[dict], within: float) -> list[str]:
    """Each run predicted outside `within`: its step as its own compute plus the rest, measured and predicted,
    beside the spread of the same model's compute measured before its other groups of this run."""
    out = []
    for v in sorted(validation, key=lambda v: -abs(v["error"])):
        if abs(v["error"]) <= within:
            continue
        # One compute a group of processes (a group's modes share it; rounds are groups of their own).
        same = {w["compute_s"] for w in validation if (w["model"], w["workers"]) == (v["model"], v["workers"])}
        parts = step_parts(v, ("blocked on peers", "RPC copies", "frames"), lambda x: f"{x * 1e3:.1f} ms")
        out.append(
            f"{v['model']} {v['mode']} {LABEL.get(v['transport'], v['transport'])}, {v['workers']} workers "
            f"({v['error'] * 100:+.0f}%): measured {v['measured_s'] * 1e3:.1f} ms a step = "
            f"{v['compute_s'] * 1e3:.1f} ms compute + {(v['measured_s'] - v['compute_s']) * 1e3:.1f} ms beyond it"
            f"{f' ({parts})' if parts else ''}; "
            f"predicted {(v['predicted_s'] - v['compute_s']) * 1e3:.1f} ms beyond it; this model's compute, "
            f"measured so before each of its {len(same)} groups of {v['workers']} workers in this run: "
            f"{min(same) * 1e3:.1f}-{max(same) * 1e3:.1f} ms."
        )
    return out


def _target(validation: list[dict]) -> Target:
    """The runs measured here predicted within 25%: the worst run and the median error."""
    worst_run = max(validation, key=lambda v: abs(v["error"]))
    worst = abs(worst_run["error"])
    median = sorted(abs(v["error"]) for v in validation)[len(validation) // 2]
    return Target(
        "scale model predicts the runs measured here within 25%",
        worst <= 0.25,
        f"worst {worst * 100:.0f}% ({worst_run['model']} {worst_run['mode']} "
        f"{LABEL.get(worst_run['transport'], worst_run['transport'])}, {worst_run['workers']} workers), "
        f"median {median * 100:.0f}%",
        why_scale_model(validation, 0.25),
    )


def _step_target(validation: list[dict]) -> list[Target]:
    """rdkeras's data-parallel step over shm costs at most its compute + the exchange the scale model predicts
    + 5%, for every model measured; where not, its measured parts name the rest."""
    runs = [v for v in validation if v["transport"] == "shm" and "fixed_s" in v]
    if not runs:
        return []
    bound = {id(v): 1.05 * (v["predicted_s"] - v["fixed_s"]) for v in runs}  # compute + exchange, + 5%
    over = [v for v in runs if v["measured_s"] > bound[id(v)]]
    why = []
    for v in over:
        exchange = v["predicted_s"] - v["fixed_s"] - v["compute_s"]  # this rank's work and its waits
        blocked = v.get("wait_seconds_per_step") or 0.0  # measured: waits only, the slower peer's compute too
        inside = v.get("exchange_seconds_per_step")  # measured inside the exchange ops: work and waits
        spent = inside if inside is not None else max(exchange, blocked)
        how = "measured inside the exchange ops" if inside is not None else "the larger of the two"
        why.append(
            f"{v['model']} {v['mode']}: {v['measured_s'] * 1e3:.1f} ms a step = {v['compute_s'] * 1e3:.1f} ms "
            f"compute + {spent * 1e3:.1f} ms exchanging ({how}; predicted {exchange * 1e3:.1f} ms; blocked on "
            f"the peer {blocked * 1e3:.1f} ms, waits for the slower worker's compute included) + "
            f"{(v['measured_s'] - v['compute_s'] - spent) * 1e3:.1f} ms beyond both (the hops into and out of "
            f"TensorFlow's ops, the assignments, Keras); a distributed step's fixed cost measured with a "
            f"300-parameter model: {v['fixed_s'] * 1e3:.1f} ms"
        )
    return [
        Target(
            "fit: every model's data-parallel step over shm ≤ its compute + the predicted exchange + 5%",
            not over,
            "step ÷ (compute + exchange): "
            + ", ".join(f"{v['model']} {v['mode']} {v['measured_s'] / bound[id(v)] * 1.05:.2f}" for v in runs),
            why,
        )
    ]


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
        "rdkeras/bench/scale_model.py. The models are keras.applications' at ImageNet size, their forward FLOPs and "
        "gradients counted here; each computes at the share of a P100's peak TensorFlow's tf_cnn_benchmarks "
        "measured for it on one P100 (DGX-1, May 2017; ResNet-101 between ResNet-50 and ResNet-152 by FLOPs), "
        "forward + backward = 3 × forward, backprop's gradients appearing in the order and at the times its layers' "
        "FLOPs say. rdkeras's gradients travel GPU → host → GPU through its numpy_function hops: each bucket is "
        "copied off the GPU as backprop produces it and back once its exchange is done, the last bucket's after "
        "everything (PCIe at 12 GB/s) — charged until a path without host staging exists.",
        "",
        "| model | image | forward GFLOPs/image | gradients | P100 share of peak, batch 64 / 32 |",
        "|---|---|---|---|---|",
    ]
    for name, m in at["models"].items():
        lines.append(
            f"| {LABELS.get(name, name)} | {m['image_size']}² | {m['forward_flops'] / 1e9:.2f} | "
            f"{m['gradient_bytes'] / 1e6:.0f} MB in {m['tensor_count']} tensors | "
            f"{_pct(m['share']['64'])} / {_pct(m['share']['32'])} |"
        )
    return lines


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
        "| GPUs | model | compute/step | predicted | Horovod published | difference | exchange after backprop | "
        "with PCIe P100s | what the exchange spends (hidden or not) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in at["horovod"]:
        lines.append(
            f"| {r['gpus']} ({r['servers']} × {hv['gpus_per_server']}) | {LABELS.get(r['model'], r['model'])} | "
            f"{r['compute_s'] * 1e3:.0f} ms | {_pct(r['efficiency'])} | {_pct(r['published'])} | "
            f"{(r['efficiency'] - r['published']) * 100:+.0f} points | {_pct(r['no_overlap'])} | "
            f"{_pct(r['pcie_p100'])} | {_spent(r['parts'])} ({sum(r['calls'].values())} allreduces) |"
        )
    return lines


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
        "| model | auto | auto, bf16 | ring | auto without host staging | Horovod published | "
        "what auto's exchange spends (hidden or not) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in at["auto"]:
        lines.append(
            f"| {LABELS.get(r['model'], r['model'])} | {_pct(r['efficiency'])} | {_pct(r['bf16']['efficiency'])} | "
            f"{_pct(r['ring'])} | {_pct(r['no_staging'])} | {_pct(r['published'])} | {_spent(r['parts'], 4)} |"
        )
    return lines


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
        "| model | " + " | ".join(f"{n} workers" for n in sizes) + f" | {sizes[-1]} ÷ {sizes[0]} | "
        f"what the exchange spends at {sizes[-1]} (hidden or not) |",
        "|---|" + "---|" * (len(sizes) + 2),
    ]
    for r in at["seed"]:
        cells = " | ".join(f"{s['rate']:.2f}" for s in r["sizes"])
        last = r["sizes"][-1]
        name = LABELS.get(r["model"], r["model"])
        lines.append(f"| {name} | {cells} | {_pct(last['vs_first'])} | {_spent(last['parts'], 4)} |")
    return [*lines, ""]


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


def render(results: dict, out: Path) -> Section:
    """The section (and scale.png where it swept cluster sizes) where the scale model was calibrated, and the
    at-scale section where it was projected to clusters of GPU servers."""
    sm = results.get("scale_model") or {}
    lines: list[str] = []
    targets: list[Target] = []
    if "validation" in sm:
        lines = tables(sm)
        if sm.get("sweeps"):
            plot(sm, out / "scale.png")
            lines += ["![Scale model](scale.png)", ""]
        targets = [_target(sm["validation"]), *_step_target(sm["validation"])] if sm["validation"] else []
    if sm.get("at_scale"):
        more, met = at_scale(sm["at_scale"])
        lines, targets = lines + more, targets + met
    return lines, targets
