"""`python -m cephalo.trainer.netprobe`: one rank of the operator's network probe (issue 35,
item 1; docs/network.md).

Two ranks, each in a pod of its own on two nodes (inter-node) or both in one pod on one node
(intra-node: CEPHALO_RANKS_PER_POD=2, this process then launches the two as a rank pod does),
join one process group (NCCL on GPUs, gloo on the CPU) through the environment the operator
sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and measure the engine's own all-gather
and reduce-scatter at 256 KiB and at up to 16 MiB (`profile_collectives.measure_link`: the
large size shrinks on a slow link so that one operation takes at most a quarter second,
and the whole probe seconds). Rank 0 writes the fitted `CollectiveProfile` as JSON to
--output (default the termination log CEPHALO_TERMINATION_LOG names: how the operator
receives it).

Bounded: joining the group gives up after CEPHALO_COLLECTIVE_TIMEOUT_SECONDS (the operator
sets it), so a node that cannot reach the other ends the probe with an error rather than
hanging; the operator's own timeout is the backstop.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

from cephalo.api import trainer_env
from cephalo.api.profile import TERMINATION_MESSAGE_LIMIT_BYTES

DEFAULT_JOIN_TIMEOUT_SECONDS = 120.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cephalo.trainer.netprobe",
                                     description=__doc__.split("\n\n")[0])
    try:
        env = trainer_env.read_env()
    except trainer_env.EnvError as err:
        print(f"netprobe: error: {err}", file=sys.stderr)
        return 2
    parser.add_argument("--output", "-o", default=env.termination_log or "-",
                        help="file for rank 0's CollectiveProfile JSON ('-' = stdout)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per size (1-50)")
    args = parser.parse_args(argv)
    if (env.ranks_per_pod or 1) > 1:  # both ranks in this pod: launch them as a rank pod does
        from cephalo.trainer.__main__ import run_pod

        return run_pod(os.environ, env.ranks_per_pod or 1, [
            sys.executable, "-m", "cephalo.trainer.netprobe", *(argv or sys.argv[1:])])
    if env.rank is None or env.world_size is None or env.world_size < 2:
        print(f"netprobe: error: needs {trainer_env.RANK} and {trainer_env.WORLD_SIZE} >= 2 "
              "(the operator sets them)", file=sys.stderr)
        return 2
    if not 1 <= args.repeats <= 50:
        print(f"netprobe: error: --repeats {args.repeats}: give 1 to 50", file=sys.stderr)
        return 2
    return _measure(env, args.output, args.repeats)


def _measure(env: trainer_env.TrainerVars, output: str, repeats: int) -> int:
    import torch
    import torch.distributed as dist

    from cephalo.trainer.env import rank_device
    from cephalo.trainer.nccl_env import init_group
    from cephalo.trainer.profile_collectives import measure_link

    try:
        device = rank_device(env.local_rank)
    except trainer_env.EnvError as err:
        print(f"netprobe: error: {err}", file=sys.stderr)
        return 2
    use_cuda = device.type == "cuda"
    if use_cuda:
        torch.cuda.set_device(device)
    if env.num_threads:
        torch.set_num_threads(env.num_threads)
    backend = "nccl" if use_cuda else "gloo"
    timeout = env.collective_timeout_seconds or DEFAULT_JOIN_TIMEOUT_SECONDS
    started = time.monotonic()
    init_group(backend, timeout=timedelta(seconds=timeout))
    try:
        fit = measure_link(device, repeats, link_bytes_per_second=env.link_bytes_per_second)
    finally:
        dist.destroy_process_group()
    if fit is None:  # not rank 0: rank 0 reports
        return 0
    text = fit.model_dump_json(exclude_none=True)
    assert len(text.encode()) <= TERMINATION_MESSAGE_LIMIT_BYTES
    if output == "-":
        print(text)
    else:
        with open(output, "w", encoding="utf-8") as f:
            f.write(text)
    print(f"netprobe: {backend} over {fit.world_size} ranks in "
          f"{time.monotonic() - started:.1f} s: all-gather "
          f"{fit.bandwidth_bytes_per_second * 8 / 1e9:.3g} Gbit/s, "
          f"{fit.latency_seconds * 1e6:.3g} us; reduce-scatter "
          f"{(fit.reduce_scatter_bandwidth_bytes_per_second or 0) * 8 / 1e9:.3g} Gbit/s; "
          f"{fit.overlap_fraction or 0.0:.2f} of the all-gather hidden under compute",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
