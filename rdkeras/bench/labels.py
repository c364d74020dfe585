"""What the paper suite's measurements and its report both name: the seed's claims, the transports' labels
and the parts of a step the transports time. Imports nothing of the suite, so either side may import it."""

from __future__ import annotations

MB = 1 << 20

# The seed's claims (slides; the arXiv version in brackets), what each figure is compared with.
SEED = {
    "sendrecv": "RDMA about 10x faster than gRPC for 1-256 MB messages",
    "throughput": "8 workers, batch 32: up to 21x gRPC.TCP [25x], about 2x gRPC.RDMA [up to 169% more]",
    "convergence": "time to the same loss 1.2-2.6x faster (CIFAR), perplexity 1.5-3.3x faster (Seq2Seq), 8 workers",
    "scalability": "1-8 workers: VGG-16 2.5-3x, LSTM about 2x gRPC.TCP",
}

LABEL = {
    "shm": "rdkeras shm",
    "tcp": "rdkeras tcp",
    "grpc": "gRPC (TCP)",
    "rpc+shm": "RPC over shm",
    "rpc+tcp": "RPC over tcp",
    "none": "Local (1 process)",
    "shm+bf16": "rdkeras shm, bf16 gradients",
}

# What the transports timed of a step besides compute, as a run (and the scale model's validation) records it.
STEP_PARTS = ("wait_seconds_per_step", "copy_seconds_per_step", "wire_seconds_per_step")
