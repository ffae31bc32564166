"""The human-readable plan: one row per rank, totals, the choices the planner made, and the
baselines side by side (`cephalo plan` prints it; `cephalo run` shows it before training)."""

from __future__ import annotations

import re

from cephalo.api import Plan
from cephalo.api.job import ModelSpec
from cephalo.api.plan import SHARD_RATIO_TOLERANCE, RankPlan
from cephalo.planner.cost.topology import ASSUMED
from cephalo.planner.search.hybrid import replicated_text
from cephalo.planner.search.offload import boundary_activations_line, plan_fused_tail_blocks
from cephalo.planner.search.precision import precision_summary

GIB = 1024**3


def format_plan(plan: Plan, model_name: str) -> str:
    """The human-readable table: one row per rank, totals, baselines side by side."""
    fraction = plan.memory_fraction if plan.memory_fraction is not None else 0.8
    lines = [f"Plan for {model_name}: global batch {plan.global_batch_size} on "
             f"{plural(plan.world_size, device_noun(plan))} (memory fraction {fraction:.0%})",
             *assumptions_lines(plan), *sharding_lines(plan), *precision_lines(plan), ""]
    header = f"{'rank':>4}  {'GPU':<10} {'prec':<4} {'batch':>5}  {'micro x n':>9}  " \
             f"{'shard':>6}  {'memory used / cap':>21}  {'step s':>8}"
    lines += [header, "-" * len(header)]
    for r in plan.ranks:
        est = "*" if r.estimated else " "
        # A plan written by hand has no predicted figures: '-', not a made-up 0.0 MiB / 0.000 s.
        mem = f"{_figure_or_dash(r.predicted_memory_bytes)} / " \
            f"{_figure_or_dash(r.memory_capacity_bytes)}"
        micro = f"{r.micro_batch_size}x{r.num_micro_batches}" if r.batch_size else "state"
        if r.extrapolated:
            micro = EXTRAPOLATED_MARK + micro
        seconds = "-" if r.predicted_step_seconds is None else f"{r.predicted_step_seconds:.3f}"
        lines.append(f"{r.rank:>4}  {r.gpu:<10} {rank_precision(plan, r):<4} "
                     f"{r.batch_size:>5}  {micro:>9}  "
                     f"{r.shard_ratio:>6.1%}  {mem:>21}  {seconds:>8}{est}")
    lines.append("-" * len(header))
    if plan.predicted_step_seconds and plan.predicted_samples_per_second:
        lines.append(f"predicted step {plan.predicted_step_seconds:.3f} s, "
                     f"{plan.predicted_samples_per_second:.2f} samples/s")
    else:
        lines.append("no prediction (a plan given by hand)")
    lines.append(activations_line(plan))
    lines.append(boundary_activations_line(plan))
    if plan.unit_shard_ratios:
        lines.append(unit_sharding_line(plan))
    lines += idle_lines(plan)
    if plan.optimality_gap_seconds:
        lines.append(f"optimality gap: at most {plan.optimality_gap_seconds:.4g} s per step "
                     "above the cost model's optimum (proven bound)")
    lines += cost_lines(plan)
    lines += baseline_lines(plan)
    notes = grouped_notes(plan.notes)
    if any(r.estimated for r in plan.ranks):
        notes = [*notes, "* = estimated from the GPU catalog; measure with "
                         "`python -m cephalo.trainer.profile` and pass --profiles"]
    if any(r.extrapolated for r in plan.ranks):
        notes = [*notes, EXTRAPOLATED_LEGEND]
    if notes:
        lines += ["", *(f"note: {n}" for n in notes)]
    return "\n".join(lines)


# A rank whose micro-batch size lies above its profile's sizes (RankPlan.extrapolated).
EXTRAPOLATED_MARK = "~"
EXTRAPOLATED_LEGEND = (
    f"{EXTRAPOLATED_MARK} = micro-batch size above the profiled ones: its time and memory "
    "are extrapolated linearly (`cephalo run` and the operator measure such sizes before "
    "they use the plan)")


def idle_lines(plan: Plan) -> list[str]:
    """The GPUs left idle, one line per reason (the planner gives every idle pool the same
    one: printed per pool, it repeated itself once per pool)."""
    by_reason: dict[str, list[str]] = {}
    for idle in plan.idle_gpus:
        by_reason.setdefault(idle.reason, []).append(
            f"{idle.count} x {idle.gpu} (pool {idle.pool})")
    return [f"idle: {', '.join(gpus)}: {reason}" for reason, gpus in by_reason.items()]


def assumptions_lines(plan: Plan) -> list[str]:
    """What the plan took as given and a preview must match to mean anything: the network
    (measured collectives, the job's planner.network or flat networkBandwidthGbps, the
    operator's node labels, or the default: then "assumed" and how to set it; a described
    rate priced at what the collective library reaches of it) and the bytes of state per
    parameter. None for a plan without them (written by hand)."""
    given = plan.assumptions
    bandwidth = given.get("network_bandwidth_bytes_per_second")
    if not isinstance(bandwidth, int | float):
        return []
    source = given.get("network_source")
    nodes = given.get("network_nodes")
    over = f" (the slowest link of a ring over {plural(nodes, 'node')})" \
        if isinstance(nodes, int) else ""
    parts = [f"network {bandwidth * 8 / 1e9:.3g} Gbit/s per GPU for collectives{over}"]
    efficiency = given.get("collective_efficiency")
    if isinstance(efficiency, int | float):  # a described rate, not a measured one
        backend = given.get("collective_backend")
        library = LIBRARY_NAMES.get(str(backend), "the collective library")
        parts.append(f"{efficiency:.2g} of the described rate (what {library} reaches of a "
                     "link, docs/network.md)")
    latency = given.get("network_latency_seconds")
    if isinstance(latency, int | float):
        parts.append(f"latency {latency * 1e6:.3g} us per hop")
    if isinstance(source, str) and source:
        parts.append(f"network source: {source}")
    state = given.get("state_bytes_per_parameter")
    if isinstance(state, int | float):
        where = " in each replica group" if plan.replica_groups else ""
        parts.append(f"{state:g} bytes of training state per parameter{where}")
    lines = ["assumes: " + ", ".join(parts)]
    if source == ASSUMED:
        lines.append(ASSUMED_NETWORK_HINT)
    return lines


def sharding_lines(plan: Plan) -> list[str]:
    """The replica groups (hybrid) or flat, why the planner chose it, and the bytes each
    kind of link carries per step; none for a plan that records no choice (sharding: flat
    keeps the plan as before, and a plan written by hand)."""
    lines = []
    groups = plan.replica_groups
    if groups:
        listed = " | ".join(_rank_span(g) for g in groups)
        kept = f"; {replicated_text(plan.replicated_fraction)}" \
            if plan.replicated_fraction else ""
        lines.append(f"sharding: hybrid, {len(groups)} replica groups of "
                     f"{plural(len(groups[0]), device_noun(plan))}: ranks {listed}{kept}")
    elif plan.assumptions.get("sharding") == "flat":
        lines.append("sharding: flat (one group of every rank)")
    reason = plan.assumptions.get("sharding_reason")
    if isinstance(reason, str) and lines:
        lines.append(f"  why: {reason}")
    moved = plan.assumptions.get("link_bytes_per_step")
    if isinstance(moved, dict) and lines:
        intra, nic = moved.get("intra_node_link_per_gpu"), moved.get("nic_per_node")
        if isinstance(intra, int | float) and isinstance(nic, int | float):
            lines.append(f"  bytes per step: intra-node link {memory_size(intra)} per GPU, "
                         f"NIC {memory_size(nic)} per node")
    return lines


def _rank_span(group: list[int]) -> str:
    """'0-7' for consecutive ranks, else '0,2,4'."""
    if group == list(range(group[0], group[0] + len(group))) and len(group) > 1:
        return f"{group[0]}-{group[-1]}"
    return ",".join(str(r) for r in group)


# The collective libraries as their projects write them (ClusterSpec.backend's values).
LIBRARY_NAMES = {"nccl": "NCCL", "gloo": "gloo"}

# How to replace an assumed network (docs/network.md has the rest).
ASSUMED_NETWORK_HINT = (
    "network assumed (defaults: 10 Gbit/s NIC per node, 128 Gbit/s PCIe inside one, each GPU "
    "on a node of its own unless told): set spec.planner.network (interNodeGbps, "
    "intraNodeGbps, nodes) or label the nodes cephalo.dev/nic-gbps (docs/network.md)")


def rank_precision(plan: Plan, rank: RankPlan) -> str:
    """The precision a rank computes in: its own, else the job's ('-': a plan without)."""
    return rank.precision or plan.precision or "-"


def precision_lines(plan: Plan) -> list[str]:
    """The job's precision and, where ranks differ (`auto`), which GPUs compute in which
    ('precision: auto: bf16 on 16 A10G, fp16 on 16 V100-16GB and 32 T4'). None for a plan
    that records no precision (written by hand)."""
    if plan.precision is None:
        return []
    line = f"precision: {plan.precision}"
    if any(r.precision for r in plan.ranks):
        line += ": " + precision_summary([rank_precision(plan, r) for r in plan.ranks],
                                         [r.gpu for r in plan.ranks])
    if plan.precision != "fp32":
        line += " (fp32 master weights and optimizer state)"
    return [line]


def device_noun(plan: Plan) -> str:
    """What the plan's ranks run on: 'CPU rank' when every rank is a plain CPU rank
    (`cephalo run --devices cpu:N`, or a plan written for CPU ranks), else 'GPU' (emulated
    GPUs included: they are named by the GPU they stand for)."""
    return "CPU rank" if plan.ranks and all(r.gpu == "cpu" for r in plan.ranks) else "GPU"


def _figure_or_dash(num_bytes: int | None) -> str:
    return f"{'-':>9}" if num_bytes is None else memory_size(num_bytes, 5)


def plural(count: int, noun: str) -> str:
    """`1 GPU`, `2 GPUs`."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def model_title(model: ModelSpec) -> str:
    """What the job calls its model: the preset, a pretrained model's folder name (with its
    family when given), or the family of a custom architecture."""
    if model.pretrained:
        name = model.pretrained.rstrip("/").rsplit("/", 1)[-1] or model.pretrained
        return f"{name} (pretrained {model.family})" if model.family else \
            f"{name} (pretrained)"
    return model.preset or model.family or "model"


_RANK_NOTE = re.compile(r"rank (\d+) \(([^)]+)\) (.+)")


def grouped_notes(notes: list[str]) -> list[str]:
    """The plan's notes, one line for consecutive ranks of one GPU that share a note ('rank
    32 (V100-16GB) offloads ...' eight times for vit-e on Cluster B)."""
    out: list[str] = []
    run: list[tuple[int, str, str]] = []  # (rank, gpu, rest) of the note being grouped

    def flush() -> None:
        if len(run) == 1:
            out.append(f"rank {run[0][0]} ({run[0][1]}) {run[0][2]}")
        elif run:
            out.append(f"ranks {run[0][0]}-{run[-1][0]} ({len(run)} x {run[0][1]}): each "
                       f"{run[0][2]}")
        run.clear()

    for note in notes:
        match = _RANK_NOTE.fullmatch(note)
        if match is None:
            flush()
            out.append(note)
            continue
        rank, gpu, rest = int(match.group(1)), match.group(2), match.group(3)
        if run and (rank != run[-1][0] + 1 or gpu != run[-1][1] or rest != run[-1][2]):
            flush()
        run.append((rank, gpu, rest))
    flush()
    return out


def memory_size(num_bytes: float, width: int = 0) -> str:
    """`40.0 MiB` below a GiB, else `22.5 GiB`: each figure in a unit that shows it (CPU
    ranks' 40 MiB read `0.0 / 2.9 GiB` with one unit for the table)."""
    unit, scale = ("GiB", GIB) if num_bytes >= GIB else ("MiB", 1024**2)
    return f"{num_bytes / scale:{width}.1f} {unit}"


def activations_line(plan: Plan) -> str:
    """The plan's recompute choice: job-wide keep-all (no recompute), or recompute with the
    blocks each rank keeps (the planner keeps activations wherever memory allows it and it
    is faster; recompute is the paper's memory-saving trick)."""
    if plan.recompute is False:
        return "activations: kept (no recompute, no second gather in the backward)"
    kept = kept_blocks_phrase(plan)
    if plan.recompute is True:  # the planner writes false or nothing: set by hand
        return f"activations: recomputed in the backward (set in the plan){kept}"
    if plan.predicted_step_seconds is None:
        return f"activations: recomputed in the backward (the engine's default){kept}"
    layers = (plan.model or {}).get("num_layers")
    if kept and plan_fused_tail_blocks(plan) == layers:  # nothing is recomputed: say so first
        return (f"activations: not recomputed; every block ({layers}) runs per microbatch "
                "with the head on every rank that has samples (parameters gathered once: the "
                "fused tail)")
    if kept:
        return f"activations: recomputed in the backward{kept}"
    return "activations: recomputed in the backward (memory: keeping them does not fit " \
        "or is not faster)"


def kept_blocks_phrase(plan: Plan) -> str:
    """'; ranks 0-3 keep the graphs of 4 of 24 blocks, ...' for ranks that keep some blocks'
    graphs in recompute mode (RankPlan.kept_blocks); empty when none does."""
    groups: list[tuple[int, int, int]] = []  # (first rank, last rank, kept blocks)
    for r in plan.ranks:
        if r.kept_blocks and groups and groups[-1][2] == r.kept_blocks \
                and groups[-1][1] == r.rank - 1:
            groups[-1] = (groups[-1][0], r.rank, r.kept_blocks)
        elif r.kept_blocks:
            groups.append((r.rank, r.rank, r.kept_blocks))
    if not groups:
        return ""
    layers = (plan.model or {}).get("num_layers")
    fused = plan_fused_tail_blocks(plan)
    if fused and fused == layers:
        return (f"; every block ({layers}) runs per microbatch with the head on every rank "
                "that has samples (no recompute, parameters gathered once: the fused tail)")
    of = f" of {layers}" if isinstance(layers, int) else ""
    parts = []
    for first, last, count in groups:
        who = f"rank {first} keeps" if first == last else f"ranks {first}-{last} keep"
        parts.append(f"{who} the graphs of {count}{of} blocks")
    if fused and fused == max(count for _, _, count in groups):
        how = "their last blocks: no recompute, run per microbatch with the head, " \
            "parameters gathered once"
    else:
        how = "their last blocks: no recompute, parameters gathered again"
        if fused:
            how += (f"; the last {fused} on every rank run per microbatch with the head, "
                    "gathered once")
    return "; " + ", ".join(parts) + f" ({how})"


def unit_sharding_line(plan: Plan) -> str:
    """How many units are sharded evenly (no uneven-collective overhead) and how many
    skewed, for a plan with per-unit ratios."""
    flat = 1.0 / plan.world_size

    def even(ratios: list[float]) -> bool:
        return all(abs(r - flat) <= SHARD_RATIO_TOLERANCE for r in ratios)

    layers = (plan.model or {}).get("num_layers")
    listed = plan.unit_shard_ratios
    listed_even = sum(even(v) for v in listed.values())
    if isinstance(layers, int):
        others = layers + 2 - len(listed)
        rank_even = even([r.shard_ratio for r in plan.ranks])
        num_even = listed_even + (others if rank_even else 0)
        return (f"units: {num_even} of {layers + 2} sharded evenly, "
                f"{layers + 2 - num_even} skewed where memory needs it (only those pay the "
                f"uneven-collective overhead; 'shard' is for the units not in "
                f"unit_shard_ratios)")
    return (f"units: {len(listed)} with their own ratios (unit_shard_ratios), "
            f"{listed_even} of them even")


def cost_lines(plan: Plan) -> list[str]:
    """What the plan costs (planner.gpuPricesPerHour): per hour for the GPUs used, per
    million samples (and tokens), and what every GPU given would cost per hour."""
    cost = plan.cost
    if cost is None:
        return []
    tokens = ("" if cost.price_per_million_tokens is None
              else f", ${cost.price_per_million_tokens:.4g} per million tokens")
    used = plural(plan.world_size, "GPU")
    line = (f"cost: ${cost.price_per_hour:.4g}/hour for the {used} used, "
            f"${cost.price_per_million_samples:.4g} per million samples{tokens}")
    if plan.idle_gpus:
        line += f"; every GPU given: ${cost.cluster_price_per_hour:.4g}/hour"
    if cost.min_samples_per_second is not None:
        line += f" (floor {cost.min_samples_per_second:.4g} samples/s)"
    return [line]


def baseline_lines(plan: Plan) -> list[str]:
    """The baselines side by side (on every GPU given), with their price per million
    samples where the plan has prices."""
    if not plan.baselines:
        return []
    cost = plan.cost
    priced = f"  {'$/M samples':>11}" if cost else ""
    lines = ["", f"{'baseline':<22} {'samples/s':>10}  {'Cephalo is':>10}{priced}"]
    for name, base in plan.baselines.items():
        if base.feasible and base.predicted_samples_per_second:
            sps = base.predicted_samples_per_second
            ratio = (plan.predicted_samples_per_second or 0) / sps
            price = "" if cost is None else \
                f"  {cost.cluster_price_per_hour / 3600 / sps * 1e6:>11.4g}"
            lines.append(f"{name:<22} {sps:>10.2f}  {ratio:>9.2f}x{price}")
        else:
            lines.append(f"{name:<22} {'does not fit':>10}  ({base.reason})")
    return lines
