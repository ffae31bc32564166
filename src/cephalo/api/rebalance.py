"""spec.planner.rebalance of a CephaloJob: live rebalancing of a running job's split of the
global batch over the same ranks (issue 45, item 1; docs/rebalancing.md).

On by default. Every `intervalSteps` steps the ranks take their measured compute seconds per
sample (smoothed) and re-solve the split with microbatch sizes and shards fixed
(cephalo.planner.feedback.rebalance); the new split takes effect at the next step boundary on every
rank, without a restart, when it is predicted to cut the slowest rank's compute by at least
`minGain`. What needs other GPUs, shards or microbatch sizes stays with re-planning
(spec.planner.replan), which restarts the gang.
"""

from __future__ import annotations

from pydantic import Field

from cephalo.api.wire import CamelModel


class RebalanceSpec(CamelModel):
    """Move samples between a running job's ranks, step by step, without a restart."""

    # On by default (issue 45 item 3): the operator shows the split in force (status.rebalance,
    # Events, metrics) and re-planning calibrates from it; a split that never pays stays the
    # plan's (minGain), and the loss is the same whatever the split.
    enabled: bool = Field(default=True, description=(
        "Re-split the global batch over the same ranks from their measured compute, at a "
        "step boundary and without a restart (false: the plan's split for the whole run)."))
    interval_steps: int = Field(default=10, ge=1, le=1_000_000, description=(
        "Steps between two decisions (each on the steps run since the split in force began)."))
    min_gain: float = Field(default=0.05, ge=0, le=100, description=(
        "Change the split only when the slowest rank's predicted compute drops by at least "
        "this fraction (0.05: 5 %, above the noise of step timings)."))
