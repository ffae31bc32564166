"""The summary and report of `bench/fsdp2.py`: the equality checks of losses and gradient
norms, Cephalo ÷ FSDP2 step-time ratios, the equal-memory tables, useful TFLOP/s and MFU,
and the text report. Pure functions of a rank's result dictionary (`fsdp2._regime`)."""

from __future__ import annotations

import statistics
from typing import Any

from fsdp2_device import MEASURED_STEPS, throughput

LOSS_RELATIVE_TOLERANCE = 1e-4
# Under bf16 autocast a value that differs in its last fp32 bits between contenders (other
# summation orders) can round to a neighbouring bf16 value, 2^-8 relative in that element
# (measured, --quick on CPU, 14 steps: losses <= 5e-5 apart, gradient norms over the first
# 12 steps <= 1.3e-3; the first step's losses equal).
BF16_LOSS_RELATIVE_TOLERANCE = 1e-2
# The gradient norms of contenders that round differently from Cephalo recompute (FSDP2's,
# and the one-microbatch ones: other matmul shapes) are held to the tolerance over the first
# steps only: later, AdamW amplifies the rounding differences (measured, communication
# regime: ≤ 8e-6 up to step 12, 1e-4 to 1.3e-3 by step 40; losses ≤ 3e-5 throughout). The
# other Cephalo contenders (recompute, keep k/L, keep: the same arithmetic) are held to
# Cephalo recompute's losses and norms at every step.
NORM_CHECKED_STEPS = 12

FSDP2_VARIANTS = ("fsdp2 per-microbatch", "fsdp2 no-sync", "fsdp2 no-sync+keep")


def pairs(names: list[str]) -> list[tuple[str, str]]:
    """(Cephalo contender, FSDP2 contender) pairs whose step-time ratio is reported: every
    Cephalo contender against every FSDP2 variant present with the same microbatching."""
    cephalo = [n for n in names if n.startswith("cephalo") and not n.endswith("1mb")]
    one = [n for n in names if n.startswith("cephalo") and n.endswith("1mb")]
    return [(c, f) for f in FSDP2_VARIANTS if f in names for c in cephalo] + \
        [(c, "fsdp2 one-microbatch") for c in one if "fsdp2 one-microbatch" in names]


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 \
        else [values[0]] * 3
    return q[0], statistics.median(values), q[2]


def _worst_difference(values: dict[str, list[float]], other_steps: int | None = None
                      ) -> float:
    """Largest relative difference of any contender's step value from Cephalo recompute's
    (over the first `other_steps` steps, when given, for contenders that round
    differently: FSDP2 and one microbatch)."""
    reference = values["cephalo recompute"]

    def steps(name: str) -> int | None:
        return other_steps if name.startswith("fsdp2") or name.endswith("1mb") else None

    return max(abs(v - ref) / abs(ref) for name, series in values.items()
               for v, ref in list(zip(series, reference, strict=True))[:steps(name)])


def _ratio(cephalo: list[float], fsdp: list[float]) -> dict[str, float]:
    """Quartiles and range of the per-round ratios (paired: same round, same load)."""
    paired = [c / f for c, f in zip(cephalo, fsdp, strict=True)]
    low, median, high = _quantiles(paired)
    return {"median": median, "p25": low, "p75": high, "min": min(paired), "max": max(paired)}


def _equal_memory(seconds: dict[str, list[float]], medians: dict[str, float],
                  peak_mib: dict[str, float], measure: str) -> dict[str, dict[str, Any]]:
    """FSDP2 variant -> the fastest Cephalo contender with the same microbatching whose peak
    (`peak_mib`, the `measure`: "rss" or "allocated") is at most the variant's, and its
    ratio (none fits: `cephalo` is None)."""
    out: dict[str, dict[str, Any]] = {}
    for fsdp in [n for n in seconds if n.startswith("fsdp2") and n in peak_mib]:  # --no-memory
        one = fsdp == "fsdp2 one-microbatch"
        fits = [n for n in seconds if n.startswith("cephalo") and n.endswith("1mb") == one
                and peak_mib[n] <= peak_mib[fsdp]]
        best = min(fits, key=lambda n: medians[n], default=None)
        out[fsdp] = {"cephalo": best, f"fsdp2_peak_{measure}_mib": peak_mib[fsdp],
                     f"cephalo_peak_{measure}_mib": None if best is None else peak_mib[best],
                     "ratio": None if best is None else _ratio(seconds[best], seconds[fsdp])}
    return out


def loss_tolerance(precision: str) -> float:
    return BF16_LOSS_RELATIVE_TOLERANCE if precision == "bf16" else LOSS_RELATIVE_TOLERANCE


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    seconds, losses = result["seconds"], result["losses"]
    worst = max(_worst_difference(losses),
                _worst_difference(result["grad_norms"], NORM_CHECKED_STEPS))
    ratios = {f"{cephalo} / {fsdp}": _ratio(seconds[cephalo], seconds[fsdp])
              for cephalo, fsdp in pairs(list(seconds))}
    medians = {n: statistics.median(s) for n, s in seconds.items()}
    tflops, mfu = throughput(result["flops_per_step"], medians, result["world_size"],
                             result["peak_flops"])
    tolerance = loss_tolerance(result["precision"])
    rss_mib = {n: kib[0] / 1024 for n, kib in result["peak_kib"].items()}
    allocated_mib = {n: b / 2**20 for n, b in result["peak_allocated_bytes"].items()}
    return {"step_seconds_median": medians, "ratios": ratios,
            "equal_memory": _equal_memory(seconds, medians, rss_mib, "rss"),
            "equal_memory_allocated": _equal_memory(seconds, medians, allocated_mib,
                                                    "allocated"),
            "max_relative_difference": worst, "loss_tolerance": tolerance,
            "losses_equal": worst <= tolerance,
            "tflops": tflops, "mfu": mfu,
            "peak_rss_mib": rss_mib, "peak_allocated_mib": allocated_mib,
            "process_peak_rss_mib": {n: kib[1] / 1024 for n, kib in result["peak_kib"].items()},
            "rounds": len(next(iter(seconds.values()))), "model": result["model"],
            "parameters": result["parameters"], "micro_batch_size": result["micro_batch_size"],
            "num_micro_batches": result["num_micro_batches"],
            "device": result["device"], "device_name": result["device_name"],
            "peak_tflops": None if result["peak_flops"] is None else result["peak_flops"] / 1e12,
            "world_size": result["world_size"], "backend": result["backend"],
            "precision": result["precision"], "gather": result.get("gather", "fp32")}


def report(regime: str, s: dict[str, Any]) -> str:
    m = s["model"]
    world, cuda = s["world_size"], s["device"] == "cuda"
    ranks = f"1 nccl rank ({s['device_name']}, {s['precision']})" if cuda else \
        f"{world} {s['backend']} ranks" + (", bf16" if s["precision"] == "bf16" else "") + \
        (", bf16 gathers" if s["gather"] == "bf16" else "")
    lines = [f"== {regime}: {m['family']} {m['num_layers']} layers, hidden {m['hidden_size']}, "
             f"seq {m['sequence_length']}, {s['parameters']:,} parameters; {ranks} x "
             f"{s['num_micro_batches']} microbatches of {s['micro_batch_size']}; "
             f"{s['rounds']} alternated rounds",
             f"losses (and gradient norms; FSDP2's and one microbatch's over the first "
             f"{NORM_CHECKED_STEPS} steps) equal across contenders: {s['losses_equal']} "
             f"(max relative difference {s['max_relative_difference']:.1e})"]
    if cuda:
        peak = "no catalog peak for this GPU: no MFU" if s["mfu"] is None else \
            f"MFU against its dense {s['precision']} peak of {s['peak_tflops']:.1f} TFLOP/s"
        lines.append(f"useful TFLOP/s (model FLOPs, recompute not counted); {peak}; memory: "
                     f"CUDA peak allocated over the build and first {MEASURED_STEPS} steps")
    for name, value in s["step_seconds_median"].items():
        memory = s["peak_rss_mib"].get(name)
        extra = (f", peak RSS +{memory:6.1f} MiB/rank over the pre-build RSS (process "
                 f"{s['process_peak_rss_mib'][name]:.0f} MiB), peak allocated "
                 f"{s['peak_allocated_mib'][name]:6.1f} MiB") if memory is not None else ""
        if cuda:
            extra = f", {s['tflops'][name]:7.2f} TFLOP/s" + (
                "" if s["mfu"] is None else f", MFU {s['mfu'][name]:6.2%}") + (
                f", peak allocated {s['peak_allocated_mib'][name]:9.1f} MiB"
                if name in s["peak_allocated_mib"] else "")
        lines.append(f"  {name:>22}: step {1e3 * value:8.1f} ms (median){extra}")
    for pair, r in s["ratios"].items():
        lines.append(f"  {pair:>45}: {_format_ratio(r)}")
    for key, measure, what in [("equal_memory", "rss", "peak RSS growth"),
                               ("equal_memory_allocated", "allocated", "peak allocated")]:
        if s[key]:
            lines.append(f"at equal memory budget by {what} (fastest Cephalo contender whose "
                         f"{what} per rank is at most the FSDP2 variant's):")
        for fsdp, e in s[key].items():
            best = "no Cephalo contender fits" if e["cephalo"] is None else (
                f"{e['cephalo']} ({e[f'cephalo_peak_{measure}_mib']:.1f} MiB) "
                f"{_format_ratio(e['ratio'])}")
            lines.append(f"  {fsdp:>22} ({e[f'fsdp2_peak_{measure}_mib']:.1f} MiB): {best}")
    return "\n".join(lines)


def _format_ratio(r: dict[str, float]) -> str:
    return (f"{r['median']:.2f} (IQR {r['p25']:.2f}-{r['p75']:.2f}, "
            f"range {r['min']:.2f}-{r['max']:.2f})")
