"""GPU paths (CUDA device, NCCL, side-stream activation offload, bf16): skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from cephalo.api.job import DataSpec, SyntheticData, TrainingSpec
from cephalo.api.models import preset
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Engine, Layout
from cephalo.trainer.spawn import free_port

pytestmark = pytest.mark.gpu


def _losses(device: torch.device, precision: str, offload: bool) -> list[float]:
    config = preset("llama-tiny")
    engine = Engine(config, TrainingSpec(steps=3, learning_rate=1e-3), Layout([8], [2], [1.0]),
                    device=device, precision=precision, offload=offload)
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    losses = [engine.step(data.micro_batches(s, 0, 8, 2)).loss for s in range(3)]
    assert engine.master_shards[0].device.type == device.type
    return losses


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_offload_and_bf16() -> None:
    import datetime
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        cuda = torch.device("cuda", 0)
        gpu = _losses(cuda, "fp32", offload=True)
        gpu_plain = _losses(cuda, "fp32", offload=False)
        gpu_bf16 = _losses(cuda, "bf16", offload=True)
    finally:
        dist.destroy_process_group()
    assert gpu == pytest.approx(gpu_plain, rel=1e-5)  # offload changes nothing numerically
    assert gpu_bf16 == pytest.approx(gpu, rel=2e-2)
