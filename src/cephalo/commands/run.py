"""`cephalo run JOB.yaml`: the whole job on this machine (see `cephalo.local`)."""

from __future__ import annotations

import argparse

from cephalo.cli import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="CephaloJob YAML (the same file the operator takes)")
    parser.add_argument("--devices", default=None,
                        help="cpu:N (gloo) | cuda (all GPUs, NCCL) | cuda:0,2 "
                             "(default: every GPU, or cpu:2 without one)")
    parser.add_argument("--emulate", default=None, metavar="GPUS",
                        help="CPU ranks emulating catalog GPUs, one per rank, e.g. "
                             "RTX-A6000,L4,L4,P40 (speed by time dilation, memory capped)")
    parser.add_argument("--emulate-memory-scale", type=float, default=None, metavar="X",
                        help="emulated memory = catalog memory x X, 0 < X <= 1 (default: "
                             "automatic; emulated GPUs only)")
    parser.add_argument("--plan", default=None, metavar="PLAN.json",
                        help="run this plan instead of profiling and planning")
    parser.add_argument("--run-dir", default=None,
                        help="run directory (default: runs/<job name>/<timestamp>)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the latest run of this job (or --run-dir) from its "
                             "last complete checkpoint")
    parser.add_argument("--steps", type=int, default=None,
                        help="override spec.training.steps")
    parser.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                        help="rank r serves Prometheus /metrics on 127.0.0.1:PORT+r while it "
                             "trains (the series a rank pod serves; default: none)")
    parser.add_argument("--stop-after-step", type=int, default=None,
                        help=argparse.SUPPRESS)  # simulates a preemption (tests)


def run(args: argparse.Namespace) -> int:
    from cephalo.local.runner import RunError, RunOptions, run_job

    if args.steps is not None and args.steps < 1:
        raise UserError("--steps must be at least 1")
    if not 0 <= args.metrics_port <= 65535:
        raise UserError(f"--metrics-port {args.metrics_port}: give a TCP port, 1 to 65535 "
                        "(rank r uses PORT+r), or 0 for none")
    options = RunOptions(job_path=args.job, devices=args.devices, emulate=args.emulate,
                         plan_path=args.plan, run_dir=args.run_dir, resume=args.resume,
                         steps=args.steps, memory_scale=args.emulate_memory_scale,
                         stop_after_step=args.stop_after_step,
                         metrics_port=args.metrics_port)
    try:
        return run_job(options)
    except RunError as err:
        raise UserError(str(err)) from None
