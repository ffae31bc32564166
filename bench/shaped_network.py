"""Two "nodes" as Linux network namespaces joined by a veth pair shaped with `tc`, gloo
ranks in them, the profiler's own collective measurement across them (issue 35, "a real
network, shaped"). Run by hand as root: `python bench/shaped_network.py [--rates 100,400]`.

Ranks 0..k-1 run in namespace A, k..2k-1 in B, each binding gloo to its namespace's veth
address: traffic between two ranks of one namespace goes to a local address, so over that
namespace's loopback (unshaped); traffic between namespaces crosses the veth pair, shaped
with a token bucket on both ends (one per direction). Traffic goes only to addresses
inside the namespaces made here; they are removed on the way out, also on failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cephalo.trainer.forked import ForkedModule, start_module, stop_all

ROOT = Path(__file__).resolve().parents[1]
ADDRESS_A, ADDRESS_B = "10.231.0.1", "10.231.0.2"
DEVICE_A, DEVICE_B = "vsa", "vsb"
# The bucket holds ~2 ms at 1 Gbit/s: enough for TCP to keep the rate, small enough that
# one op's bytes are mostly paced (measured: a 200 kB bucket at 100 Mbit/s lets a 4 MB op
# through 5 % faster than the rate).
BURST_BYTES = 32_000
QUEUE_LATENCY = "20ms"
# Niceness of what a timed measurement starts: on a machine shared with other builds their
# bursts otherwise move a 1-core rank's step by ±35 % (measured: one rank alone, the same
# work, 0.38–0.76 s per step at load 11); above them, the profile and the run both see
# cores as the planner assumes they have. With the kernel's autogroups (Linux's default,
# /proc/sys/kernel/sched_autogroup_enabled) a process's niceness ranks it only inside its
# session: each other session (a control plane, another build) gets an equal share of the
# cores whatever its niceness, so each timed process starts a session of its own and that
# session's autogroup gets TIMED_NICENESS too (`start_timed`).
TIMED_NICENESS = -20


def unavailable() -> str | None:
    """Why namespaces cannot be made here (one reason), or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (iproute2) on PATH"
    return None


@dataclass(frozen=True)
class Nodes:
    """Two namespaces joined by one shaped veth pair."""

    a: str
    b: str
    rate_mbit: float


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@contextmanager
def shaped_nodes(rate_mbit: float) -> Iterator[Nodes]:
    """Namespaces A and B (names unique to this call), a veth pair between them with
    ADDRESS_A / ADDRESS_B, each end shaped to `rate_mbit`; removed on exit whatever
    happened (deleting a namespace deletes its end of the pair, and with it the other)."""
    tag = uuid.uuid4().hex[:8]
    nodes = Nodes(a=f"cephalo-shape-a-{tag}", b=f"cephalo-shape-b-{tag}", rate_mbit=rate_mbit)
    made: list[str] = []
    try:
        for ns in (nodes.a, nodes.b):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", nodes.a, "link", "add", DEVICE_A, "type", "veth", "peer", "name", DEVICE_B,
            "netns", nodes.b)
        for ns, dev, address in ((nodes.a, DEVICE_A, ADDRESS_A), (nodes.b, DEVICE_B, ADDRESS_B)):
            _ip("-n", ns, "addr", "add", f"{address}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                            f"{rate_mbit}mbit", "burst", str(BURST_BYTES), "latency",
                            QUEUE_LATENCY], check=True, capture_output=True, timeout=20)
        yield nodes
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def start_timed(args: list[str], niceness: int = TIMED_NICENESS,
                **popen: Any) -> subprocess.Popen[Any]:
    """Popen for a timed process (root only): at `niceness` (through `nice`, so every thread
    it starts inherits it), in a session of its own whose autogroup runs at `niceness` too
    (sched(7), "The autogroup feature"). Where the kernel has no autogroups (no
    /proc/PID/autogroup) niceness alone applies."""
    adjustment = niceness - os.getpriority(os.PRIO_PROCESS, 0)
    proc = subprocess.Popen(["nice", "-n", str(adjustment), *args], start_new_session=True,
                            **popen)
    # No autogroups here (or the process already gone): niceness alone.
    with contextlib.suppress(OSError):
        Path(f"/proc/{proc.pid}/autogroup").write_text(f"{niceness}\n")
    return proc


def start_timed_module(module: str, args: list[str], env: dict[str, str], *, log: Path,
                       cwd: Path = ROOT, netns: str | None = None,
                       niceness: int = TIMED_NICENESS) -> ForkedModule:
    """`python -m module args`, timed as `start_timed` starts a command (niceness, a session
    and autogroup of its own), in network namespace `netns` as `ip netns exec` would run it,
    its output appended to `log`; forked from the fork server (cephalo.trainer.forked), so
    it does not pay torch's imports (~2.5 s of CPU each) before its timed work."""
    return start_module(module, args, env, cwd=cwd, log=log, netns=netns, niceness=niceness)


def wait_all(start: Callable[[int], ForkedModule], logs: list[Path],
             timeout_seconds: float) -> None:
    """Start process i with `start(i)` for each of `logs` (its output), wait for all; none
    is left running, also on failure. Raises with the first failing one's log."""
    procs: list[ForkedModule] = []
    try:
        for i in range(len(logs)):
            procs.append(start(i))
        for proc in procs:
            proc.wait(timeout=timeout_seconds)
    finally:
        stop_all(procs)
    for i, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        if proc.returncode != 0:
            raise RuntimeError(f"process {i} ({log.name}) failed (exit {proc.returncode}): "
                               f"{log.read_text(errors='replace')[-2000:]}")


# Each rank of the profiler's measurement (`cephalo profile --collectives` runs the same
# function under torchrun), its fit printed as JSON by rank 0. The bandwidth probe is cut
# from 16 MiB to BIG_ELEMENTS so a slow shape finishes in seconds.
_RANK = """
import json, sys, torch
torch.set_num_threads(1)
import cephalo.trainer.profile_collectives as pc
from cephalo.api.models import preset
pc.BANDWIDTH_PROBE_ELEMENTS = int(sys.argv[1])
if sys.argv[3] == "quick":  # without the one-sample training-step probe (seconds of CPU)
    pc._probe_fits = lambda *args: False
fit = pc.measure_collectives(preset(sys.argv[4]), repeats=int(sys.argv[2]))
if fit is not None:
    print("FIT " + json.dumps(fit.model_dump()))
"""
# What `measure` runs: the profiler's measurement with its one-sample training-step probe
# ("full") or without it ("quick"), both of the model's unit sizes; or the operator's
# network probe (`python -m cephalo.trainer.netprobe`, "netprobe": the link alone, 256 KiB
# and a large size that shrinks to a quarter second per operation on a slow link).
PROBES = ("full", "quick", "netprobe")


def measure(nodes: Nodes, ranks_per_node: int = 2, big_elements: int = 1024**2,
            repeats: int = 3, timeout_seconds: float = 120.0, probe: str = "full",
            model: str = "gpt-tiny") -> dict[str, float]:
    """Run a collective measurement (`probe`, one of PROBES) over 2 x ranks_per_node gloo
    ranks, the first half in A, the rest in B; rank 0's fit (CollectiveProfile fields).
    `model` (a preset) sets the profiler's small probe's size (one unit) and its
    training-step probe's model; `big_elements` its bandwidth probe's."""
    if probe not in PROBES:
        raise ValueError(f"probe {probe!r}: one of {', '.join(PROBES)}")
    world = 2 * ranks_per_node
    if probe == "netprobe":
        return _measure_netprobe(nodes, ranks_per_node, repeats, timeout_seconds)
    command = [sys.executable, "-c", _RANK, str(big_elements), str(repeats), probe, model]
    procs = []
    for rank in range(world):
        in_a = rank < ranks_per_node
        procs.append(start_timed(
            ["ip", "netns", "exec", nodes.a if in_a else nodes.b, *command],
            env=_rank_env(rank, world, ranks_per_node), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, cwd=ROOT))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout_seconds))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outputs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"a rank failed (exit {p.returncode}): {err[-2000:]}")
    return _fit_of(outputs[0][0])


def _rank_env(rank: int, world: int, ranks_per_node: int) -> dict[str, str]:
    """A measuring rank's environment: the first `ranks_per_node` ranks in A, the rest in B."""
    return {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank % ranks_per_node), "MASTER_ADDR": ADDRESS_A,
            "MASTER_PORT": "29511",
            "GLOO_SOCKET_IFNAME": DEVICE_A if rank < ranks_per_node else DEVICE_B,
            "OMP_NUM_THREADS": "1", "CEPHALO_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def _measure_netprobe(nodes: Nodes, ranks_per_node: int, repeats: int,
                      timeout_seconds: float) -> dict[str, float]:
    """The operator's network probe on every rank, forked (start_timed_module)."""
    world = 2 * ranks_per_node
    with tempfile.TemporaryDirectory(prefix="netprobe-") as tmp:
        logs = [Path(tmp) / f"rank-{rank}.log" for rank in range(world)]
        wait_all(lambda rank: start_timed_module(
            "cephalo.trainer.netprobe", ["--output", "-", "--repeats", str(repeats)],
            _rank_env(rank, world, ranks_per_node), log=logs[rank],
            netns=nodes.a if rank < ranks_per_node else nodes.b), logs, timeout_seconds)
        return _fit_of(logs[0].read_text(errors="replace"))


def _fit_of(output: str) -> dict[str, float]:
    """Rank 0's fit from its output (the profiler's "FIT {...}" or the probe's JSON line)."""
    for line in output.splitlines():
        if line.startswith(("FIT ", "{")):
            return dict(json.loads(line.removeprefix("FIT ")))
    raise RuntimeError(f"rank 0 printed no fit: {output[-2000:]}")


def link_figures(fit: dict[str, float], rate_mbit: float) -> dict[str, float]:
    """The profiler's ring-model fits in Mbit/s, and the link's rate they imply.

    On gloo the engine's reduce-scatter is an all-reduce of the full buffer (a ring over the
    ranks in rank order: each hop carries 2(n-1)/n of the bytes, both directions at once),
    while the fit prices it as a reduce-scatter ((n-1)/n of the bytes): the link carries
    twice the fitted bandwidth. The all-gather is one broadcast per shard
    (trainer/collectives.py), not a ring: its fit is reported as measured, not converted."""
    to_mbit = 8 / 1e6
    reduce_scatter = fit["reduce_scatter_bandwidth_bytes_per_second"] * to_mbit
    all_gather = fit["bandwidth_bytes_per_second"] * to_mbit
    return {"all_gather_mbit": all_gather, "reduce_scatter_mbit": reduce_scatter,
            "link_mbit": 2 * reduce_scatter, "link_vs_shaped": 2 * reduce_scatter / rate_mbit,
            "all_gather_vs_shaped": all_gather / rate_mbit}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="100,400", help="Mbit/s, comma-separated")
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--big-elements", type=int, default=256 * 1024)
    parser.add_argument("--probe", choices=PROBES, default="full",
                        help="the profiler's measurement with or without its training-step "
                             "probe, or the operator's network probe")
    args = parser.parse_args()
    reason = unavailable()
    if reason:
        print(f"shaped_network: {reason}", file=sys.stderr)
        return 2
    for rate in (float(r) for r in args.rates.split(",")):
        with shaped_nodes(rate) as nodes:
            fit = measure(nodes, args.ranks_per_node, args.big_elements, probe=args.probe)
        print(json.dumps({"rate_mbit": rate, "ranks_per_node": args.ranks_per_node,
                          **{k: round(v, 3) for k, v in link_figures(fit, rate).items()},
                          "latency_us": round(fit["latency_seconds"] * 1e6, 1),
                          "probe_step_seconds": fit.get("probe_step_seconds")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
