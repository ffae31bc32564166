"""Joining the process group, with what NCCL needs set first (issue 43, item 4).

The engine frees each gathered unit as soon as its compute is queued, and the host may run
units ahead of the GPU. Its buffers are allocated on the compute stream and every
collective's `Work` is waited before its result is used, so, where torch's NCCL backend
*stashes* a collective's tensors until `wait()` (torch >= 2.7, later the only behaviour),
the caching allocator reuses a freed unit buffer in compute-stream order: device memory
follows the host's order of allocations and frees, the two unit buffers in flight that the
memory model (cephalo.api.memory) counts, however far ahead the host is.

Older torch (the trainer accepts >= 2.4) instead `record_stream`s them on NCCL's stream by
default: a freed buffer is reusable only once the allocator sees NCCL's events complete, so
a host running ahead allocates fresh blocks and peak memory can exceed the model.
`TORCH_NCCL_AVOID_RECORD_STREAMS=1` (read when the process group is created) selects
stashing there. Chosen over bounding the gathers in flight with events (FSDP1's
`limit_all_gathers`): that adds a host wait per unit to every torch for a problem only the
old default has; FSDP2 needs its limits because it allocates gathers on a stream of its
own, which this engine does not. From torch 2.8 the variable is deprecated (a warning,
no effect), so it is set only below that, and never over a value the user set.
"""

from __future__ import annotations

import os
from datetime import timedelta

AVOID_RECORD_STREAMS = "TORCH_NCCL_AVOID_RECORD_STREAMS"
# The first torch whose NCCL backend always stashes (the variable only warns there); 2.7
# may already, where setting it is harmless.
STASHING_BY_DEFAULT = "2.8"


def nccl_environment(torch_version: str) -> dict[str, str]:
    """What an NCCL rank's environment needs before its process group is created."""
    from torch.torch_version import TorchVersion

    if TorchVersion(torch_version) < STASHING_BY_DEFAULT:
        return {AVOID_RECORD_STREAMS: "1"}
    return {}


def init_group(backend: str, timeout: timedelta, rank: int = -1, world_size: int = -1
               ) -> None:
    """`dist.init_process_group(backend, ...)`, NCCL's environment prepared first (torch
    reads it when the group is created)."""
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        for name, value in nccl_environment(torch.__version__).items():
            os.environ.setdefault(name, value)
    # -1: torch's own default, the environment's RANK and WORLD_SIZE (torchrun's).
    dist.init_process_group(backend, timeout=timeout, rank=rank, world_size=world_size)
