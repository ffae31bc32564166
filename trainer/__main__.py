"""`python -m cephalo.trainer` (also under `torchrun -m cephalo.trainer`): one rank of a
Cephalo job, driven entirely by the environment described in docs/architecture.md.

A pod that holds several GPUs of a node (CEPHALO_RANKS_PER_POD = k > 1, set by the operator)
runs k ranks: this process becomes a small launcher that starts k trainer processes, the
pod's first RANK + i with LOCAL_RANK i (so process i drives GPU i and ranks on one node talk
over NVLink/P2P), and exits with the first failure. Not torchrun: torchrun numbers ranks
node_rank × nproc + local_rank, which cannot follow a plan whose pods hold different
numbers of GPUs; the plan's rank order is what gives every GPU its batch and shard.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from cephalo.api.trainer_env import EnvError, pod_process_environ, read_env

# After one process failed, how long the others get to leave on SIGTERM (they would hang
# in a collective otherwise) before SIGKILL.
STOP_GRACE_SECONDS = 30.0
POLL_SECONDS = 0.2


def _stop(children: Sequence[subprocess.Popen[bytes]], grace_seconds: float) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def run_pod(env: Mapping[str, str], count: int, command: Sequence[str] | None = None,
            grace_seconds: float = STOP_GRACE_SECONDS) -> int:
    """Start `count` rank processes (`command`, default this module) and wait: 0 when all
    succeed, else the first failing process's exit code (the others are stopped). SIGTERM
    to the pod is passed on, so every rank reaches its step boundary and checkpoints."""
    argv = list(command or [sys.executable, "-m", "cephalo.trainer"])
    environs = [pod_process_environ(env, i) for i in range(count)]  # EnvError before any start
    children: list[subprocess.Popen[bytes]] = []
    signalled: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        signalled.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    # The handlers come first: a SIGTERM while the ranks start must reach them, not kill
    # this process (PID 1 of the pod) and with it every rank before it can checkpoint.
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for environ in environs:
            children.append(subprocess.Popen(argv, env=environ))
            if signalled:  # stopped while starting: this rank is told too
                children[-1].send_signal(signalled[-1])
        while True:
            codes = [child.poll() for child in children]
            failed = [c for c in codes if c not in (None, 0)]
            if failed and signalled and None in codes:
                # The pod is stopping (preemption, deletion): every rank is checkpointing at
                # the agreed step; let each finish (the kubelet's grace period bounds it).
                time.sleep(POLL_SECONDS)
                continue
            if failed:
                _stop(children, grace_seconds)
                return int(failed[0]) if failed[0] > 0 else 128 - int(failed[0])
            if all(c == 0 for c in codes):
                return 0
            time.sleep(POLL_SECONDS)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stop(children, 0.0)


def main() -> int:
    try:
        count = read_env().ranks_per_pod or 1
    except EnvError:
        count = 1  # the rank itself reports a malformed environment, as every rank does
    if count > 1:
        try:
            return run_pod(os.environ, count)
        except EnvError as err:
            print(f"cephalo trainer (pod of {count} ranks): error: {err}", file=sys.stderr,
                  flush=True)
            return 2
    from cephalo.trainer.run import main as rank_main

    return rank_main()


if __name__ == "__main__":
    raise SystemExit(main())
