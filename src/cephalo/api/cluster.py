"""ClusterSpec: the GPUs a plan may use, grouped into pools of one product each."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MAX_GPUS_PER_GROUP = 100_000


class GpuGroup(BaseModel):
    model_config = ConfigDict(extra="forbid")

    product: str = Field(description="catalog name (e.g. L4) or a discovery label")
    # The same bound as a job's gpuPools[].maxGpus: beyond any real cluster.
    count: int = Field(ge=1, le=MAX_GPUS_PER_GROUP)
    pool: str | None = Field(default=None, description="pool name; default: the product")
    memory_bytes: int | None = Field(default=None, ge=1, description="override the catalog")


class ClusterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    groups: list[GpuGroup] = Field(min_length=1)
    network_bandwidth_bytes_per_second: float | None = Field(default=None, gt=0)
    network_latency_seconds: float | None = Field(default=None, ge=0)

    @property
    def num_gpus(self) -> int:
        return sum(g.count for g in self.groups)
