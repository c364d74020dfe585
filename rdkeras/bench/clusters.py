"""The scale model on clusters of GPU servers, checked against a table nobody here wrote.

Horovod's published benchmark -- 128 servers of 4 Pascal GPUs, 25 Gbit/s RoCE, batch 64 per GPU, ResNet-101,
Inception V3 and VGG-16 at ImageNet size -- reached 90%, 90% and 68% scaling efficiency at 512 GPUs (and
90/90/79% on 32 such servers, an earlier version of the same page). The scale model predicts it for a flat
NCCL ring with Horovod's tensor fusion (``scale_model.horovod_step``), from the models' FLOPs and gradients
counted here from keras.applications and a P100's measured speed on each; then projects rdkeras's own
``auto`` (and ``auto`` with bf16 compression) on that cluster, and on the seed's testbed up to 1024 workers,
with rdkeras's gradients staged through the host as its numpy_function hops stage them today.

Every constant is cited where it is defined; nothing is fitted to Horovod's figures.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from typing import Any

from rdkeras.bench import scale_model
from rdkeras.bench.scale_model import MB, Testbed

# Horovod's scaling efficiency (throughput at N GPUs / N x one GPU's), by GPUs: horovod/horovod docs/benchmarks.rst
# at 27743d0 (128 servers x 4 Pascal GPUs, "RoCE-capable 25 Gbit/s network", tf_cnn_benchmarks --batch_size 64
# --variable_update horovod) and docs/benchmarks.md at 059867d (the same on 32 servers).
HOROVOD_PUBLISHED: dict[int, dict[str, float]] = {
    512: {"resnet101": 0.90, "inception_v3": 0.90, "vgg16": 0.68},
    128: {"resnet101": 0.90, "inception_v3": 0.90, "vgg16": 0.79},
}
HOROVOD_BATCH = 64  # per GPU (docs/benchmarks.rst's command line)
HOROVOD_FUSION_BYTES = 64 * MB  # HOROVOD_FUSION_THRESHOLD's default (horovod docs/tensor-fusion.md at 979ff10)

# Images/s of one P100 in tf_cnn_benchmarks, synthetic data, by batch (tensorflow/tensorflow
# tensorflow/docs_src/performance/benchmarks.md at 5984ffe, "Details for NVIDIA DGX-1 (NVIDIA Tesla P100)", May
# 2017, "Training synthetic data", 1 GPU: the SXM2 P100, 10.6 TFLOP/s fp32 peak by NVIDIA's Tesla P100 datasheet).
TF_P100_IMAGES_PER_S: dict[int, dict[str, float]] = {
    64: {"inception_v3": 142, "resnet50": 219, "resnet152": 91.8, "vgg16": 154},
    32: {"inception_v3": 128, "resnet50": 195, "resnet152": 82.7, "vgg16": 144},
}
TF_P100_TFLOPS = 10.6
# Forward FLOPs per image of the two ResNets that bracket ResNet-101 in that table, counted by
# workloads.forward_flops from keras.applications.ResNet50/ResNet152 at 224x224 (test_scale_model recounts
# them, -m slow).
RESNET_FLOPS = {"resnet50": 7_715_946_496, "resnet152": 22_564_831_232}

# The models: keras.applications' definitions at ImageNet size.
APPLICATIONS = {"resnet101": ("ResNet101", 224), "inception_v3": ("InceptionV3", 299), "vgg16": ("VGG16", 224)}
LABELS = {"resnet101": "ResNet-101", "inception_v3": "Inception V3", "vgg16": "VGG-16"}

# Horovod's cluster. Its GPUs ("Pascal") taken as the P100 TensorFlow measured the models on (SXM2, 10.6
# TFLOP/s), so each model computes at its measured speed; the report adds the PCIe P100's (9.3) beside it.
HOROVOD_CLUSTER = Testbed(workers=512, gpus_per_server=4, gpu_tflops=TF_P100_TFLOPS, link_gbps=25.0)
SEED_TESTBED = Testbed()  # 8 servers, a P100 (PCIe) each, 100 Gb/s InfiniBand
SEED_BATCH = 32  # per worker, as the seed's projection
SEED_WORKERS = [8, 64, 256, 1024]


def application_profile(name: str) -> dict[str, Any]:
    """A keras.applications model's forward FLOPs per image, gradient bytes and, for each gradient in backprop's
    order, [share of backprop done when it exists, bytes] (each layer's backward taken as twice its forward
    FLOPs, so the shares follow the layers' FLOPs). Builds the model (seconds)."""
    from types import SimpleNamespace

    import keras

    from rdkeras.bench import workloads

    cls, size = APPLICATIONS[name]
    model = getattr(keras.applications, cls)(weights=None, input_shape=(size, size, 3), classes=1000)
    flops = [workloads.forward_flops(SimpleNamespace(layers=[layer])) for layer in model.layers]
    total, done, tensors = sum(flops), 0, []
    for layer, f in zip(reversed(model.layers), reversed(flops), strict=True):
        done += f
        tensors += [[done / total, 4 * math.prod(w.shape)] for w in layer.trainable_weights]  # float32 gradients
    profile = {
        "name": name,
        "image_size": size,
        "forward_flops": total,
        "gradient_bytes": sum(b for _, b in tensors),
        "params": int(model.count_params()),
        "tensors": tensors,
    }
    del model
    keras.backend.clear_session()
    return profile


def gpu_share(name: str, batch: int, forward_flops: int) -> float:
    """A model's sustained share of a P100's peak in training (3 x forward FLOPs an image, at the measured images/s;
    above 1 where cuDNN's Winograd convolutions do fewer multiplies than counted, as VGG-16's 3x3 ones). ResNet-101,
    not in the table, between ResNet-50 and ResNet-152 by its FLOPs."""
    rates = TF_P100_IMAGES_PER_S[batch]

    def share(model: str, flops: float) -> float:
        return 3 * flops * rates[model] / (TF_P100_TFLOPS * 1e12)

    if name in rates:
        return share(name, forward_flops)
    if name != "resnet101":
        raise ValueError(f"no measured P100 speed for {name}")
    lo, hi = (share(m, RESNET_FLOPS[m]) for m in ("resnet50", "resnet152"))
    return lo + (hi - lo) * (forward_flops - RESNET_FLOPS["resnet50"]) / (
        RESNET_FLOPS["resnet152"] - RESNET_FLOPS["resnet50"]
    )


def compute_seconds(profile: dict[str, Any], batch: int, testbed: Testbed) -> float:
    """One step's forward and backward pass (3 x forward FLOPs) at the model's measured share of the GPU's peak."""
    share = gpu_share(profile["name"], batch, profile["forward_flops"])
    return 3 * profile["forward_flops"] * batch / (testbed.gpu_tflops * 1e12 * share)


def _step_row(step: scale_model.Step) -> dict[str, Any]:
    return {
        "efficiency": step.efficiency,
        "step_s": step.step_s,
        "compute_s": step.compute_s,
        "parts": step.parts,
        "dominant": step.dominant,
        "calls": step.calls,
    }


def horovod_comparison(profiles: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The flat NCCL ring's predicted scaling efficiency on Horovod's clusters beside Horovod's published one; also
    without overlap, and with PCIe P100s (9.3 TFLOP/s: slower compute, so higher efficiency)."""
    rows = []
    for gpus, published in HOROVOD_PUBLISHED.items():
        cluster = replace(HOROVOD_CLUSTER, workers=gpus)
        for name, expected in published.items():
            p = profiles[name]
            compute = compute_seconds(p, HOROVOD_BATCH, cluster)
            ring = scale_model.horovod_step(p["tensors"], compute, cluster, HOROVOD_FUSION_BYTES)
            after = scale_model.horovod_step(p["tensors"], compute, cluster, HOROVOD_FUSION_BYTES, overlap=False)
            pcie = replace(cluster, gpu_tflops=SEED_TESTBED.gpu_tflops)
            slower = compute_seconds(p, HOROVOD_BATCH, pcie)
            rows.append(
                {
                    "gpus": gpus,
                    "servers": cluster.servers,
                    "model": name,
                    "published": expected,
                    **_step_row(ring),
                    "no_overlap": after.efficiency,
                    "pcie_p100": scale_model.horovod_step(p["tensors"], slower, pcie, HOROVOD_FUSION_BYTES).efficiency,
                }
            )
    return rows


def auto_on_horovod(profiles: dict[str, dict[str, Any]], gpus: int = 512) -> list[dict[str, Any]]:
    """rdkeras's `auto` on Horovod's cluster (fp32, and with compression="bf16"), and its flat ring, gradients staged
    through the host; beside Horovod's published efficiency."""
    cluster = replace(HOROVOD_CLUSTER, workers=gpus)
    rows = []
    for name, expected in HOROVOD_PUBLISHED[gpus].items():
        p = profiles[name]
        compute = compute_seconds(p, HOROVOD_BATCH, cluster)
        auto = scale_model.rdkeras_step(p["tensors"], compute, cluster, "auto")
        unstaged = scale_model.rdkeras_step(p["tensors"], compute, cluster, "auto", staging=False)
        rows.append(
            {
                "gpus": gpus,
                "model": name,
                "published": expected,
                **_step_row(auto),
                "bf16": _step_row(scale_model.rdkeras_step(p["tensors"], compute, cluster, "auto", wire=0.5)),
                "ring": scale_model.rdkeras_step(p["tensors"], compute, cluster, "ring").efficiency,
                "no_staging": unstaged.efficiency,
            }
        )
    return rows


def seed_sweep(profiles: dict[str, dict[str, Any]], workers: list[int] = SEED_WORKERS) -> list[dict[str, Any]]:
    """rdkeras's `auto` on the seed's testbed (a P100 and a 100 Gb/s NIC a server) at each size: per-worker
    mini-batches/s, and against the first size's."""
    rows = []
    for name in ("vgg16", "inception_v3"):
        p = profiles[name]
        compute = compute_seconds(p, SEED_BATCH, SEED_TESTBED)
        sizes = []
        for n in workers:
            step = scale_model.rdkeras_step(p["tensors"], compute, replace(SEED_TESTBED, workers=n), "auto")
            sizes.append({"workers": n, "rate": 1 / step.step_s, **_step_row(step)})
        for s in sizes:
            s["vs_first"] = s["rate"] / sizes[0]["rate"]
        rows.append({"model": name, "sizes": sizes})
    return rows


def analyze(profiles: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Everything the report's at-scale section prints (`profiles`: application_profile of each model; built
    here where not given)."""
    profiles = profiles or {name: application_profile(name) for name in APPLICATIONS}
    clusters = {"horovod": asdict(HOROVOD_CLUSTER), "seed": asdict(SEED_TESTBED)}
    return {
        "clusters": clusters,
        "models": {
            name: {
                **{k: v for k, v in p.items() if k != "tensors"},
                "tensor_count": len(p["tensors"]),
                "share": {str(b): gpu_share(name, b, p["forward_flops"]) for b in (HOROVOD_BATCH, SEED_BATCH)},
            }
            for name, p in profiles.items()
        },
        "horovod": horovod_comparison(profiles),
        "auto": auto_on_horovod(profiles),
        "seed": seed_sweep(profiles),
        "profiles": profiles,
    }
