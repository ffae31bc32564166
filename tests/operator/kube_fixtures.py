"""Node and CephaloJob dicts for operator tests: the paper's Cluster A as GPU-labelled nodes.

Cluster A (paper §5): 2xL4, 1xA6000, 1xP40 in one machine, 2xP40, 2xP100 in the other.
GPU Feature Discovery labels one product per node, so each (machine, product) is a node here.
"""

from __future__ import annotations

from typing import Any

CLUSTER_A: list[tuple[str, str, int, int]] = [  # (node, nvidia.com/gpu.product, GPUs, MiB)
    ("a-l4", "NVIDIA-L4", 2, 23034),
    ("a-a6000", "NVIDIA-RTX-A6000", 1, 49140),
    ("a-p40", "Tesla-P40", 1, 24576),
    ("b-p40", "Tesla-P40", 2, 24576),
    ("b-p100", "Tesla-P100-PCIE-16GB", 2, 16384),
]


def gpu_node(name: str, product: str | None, gpus: int, memory_mib: int | None = None, *,
             ready: bool = True, unschedulable: bool = False) -> dict[str, Any]:
    labels = {"kubernetes.io/hostname": name}
    if product is not None:
        labels["nvidia.com/gpu.product"] = product
        labels["nvidia.com/gpu.count"] = str(gpus)
    if memory_mib is not None:
        labels["nvidia.com/gpu.memory"] = str(memory_mib)
    return {
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
        "spec": {"unschedulable": True} if unschedulable else {},
        "status": {
            "allocatable": {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": str(gpus)},
            "capacity": {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": str(gpus)},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def cluster_a() -> list[dict[str, Any]]:
    return [gpu_node(*entry) for entry in CLUSTER_A] + [gpu_node("cpu-0", None, 0)]


def job_body(name: str = "gpt", namespace: str = "default", uid: str | None = None,
             **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"image": "registry.example/cephalo-trainer:0.1.0",
                 "model": {"preset": "gpt-small"}, "globalBatchSize": 64,
                 "training": {"steps": 100},
                 # a multi-rank job needs a shared checkpoint target (else it is refused)
                 "checkpoint": {"claimName": "ckpt"},
                 # gpt-small at B=64 is fastest on one GPU: the gang tests need every rank,
                 # each in its own pod (tests of several ranks a pod say so)
                 "planner": {"chooseGpus": False}, "ranksPerPod": 1, **spec},
    }
    if uid is not None:
        body["metadata"]["uid"] = uid
    return body
