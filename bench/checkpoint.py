"""What checkpoints cost a training run (issue 13): asynchronous vs synchronous checkpoints
every `--interval` steps against no checkpoints at all, on the CPU quickstart model
(gpt-small, global batch 24, 2 gloo ranks), to a local folder and to an S3-compatible server
(moto in server mode, started here, over HTTP on 127.0.0.1); plus the raw upload and download
throughput to that server.

The three set-ups run interleaved `--repeats` times (this machine is shared: interleaving
spreads the noise evenly) and every run has the per-step vote (the SIGTERM handler that
`python -m cephalo.trainer` always installs), so the only difference is the checkpointing.
Step time = mean gap between consecutive step boundaries after `--warmup` steps, up to the
last step (the final, always synchronous checkpoint is not part of it). Two overheads are
printed: end-to-end (step time vs the run without checkpoints; on a shared machine this moves
by more than the effect) and the share of the time the training thread spent blocked in
checkpoint calls (snapshot, agreement, waiting for an unfinished upload), the part that is
immune to that noise but not to the upload thread's competition for the cores. Target:
async overhead <= 5 % of the step time.

Run: python bench/checkpoint.py [--steps 60] [--interval 20] [--repeats 3]
     [--targets local,s3] [--blob-mib 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cephalo.api.job import CephaloJobSpec
from cephalo.trainer.engine import Layout
from cephalo.trainer.spawn import spawn_ranks
from cephalo.trainer.storage import Store

LAYOUT = Layout([12, 12], [4, 4], [0.5, 0.5])
BUCKET = "bench"


def job(steps: int, interval: int) -> CephaloJobSpec:
    return CephaloJobSpec.model_validate({
        "model": {"preset": "gpt-small"}, "globalBatchSize": 24,
        "training": {"steps": steps, "learningRate": 3e-3, "warmupSteps": 3},
        "checkpoint": {"intervalSteps": interval, "keep": 2}})


def _worker(rank: int, world_size: int, env: dict[str, str], target: str | None,
            steps: int, interval: int, asynchronous: bool
            ) -> tuple[list[float], list[tuple[float, float]]]:
    from cephalo.trainer import run

    os.environ.update(env)
    boundaries: list[float] = []
    blocked: list[tuple[float, float]] = []  # training thread inside a checkpoint call

    def at_boundary() -> bool:
        boundaries.append(time.perf_counter())
        return False

    def timed(method):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                blocked.append((started, time.perf_counter()))
        return wrapper

    writer = run.CheckpointWriter
    writer.start = timed(writer.start)  # type: ignore[method-assign]
    writer.finish = timed(writer.finish)  # type: ignore[method-assign]
    run.train(job(steps, interval), LAYOUT, target, verbose=False, stop_requested=at_boundary,
              async_checkpoints=asynchronous)
    return boundaries, blocked


def measure(boundaries: list[float], blocked: list[tuple[float, float]], warmup: int
            ) -> tuple[float, float]:
    """(mean step seconds, share of that time the training thread spent in checkpoint calls)
    from the first boundary after warm-up to the last (before the final checkpoint)."""
    first, last = boundaries[warmup], boundaries[-1]
    in_calls = sum(e - s for s, e in blocked if s >= first and e <= last)
    return (last - first) / (len(boundaries) - 1 - warmup), in_calls / (last - first)


@contextmanager
def moto_s3() -> Iterator[dict[str, str]]:
    """The tests' moto S3 server (tests/moto_s3.py) with a bucket and credentials."""
    import boto3

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from moto_s3 import moto_server

    with moto_server() as url:
        env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "bench",
               "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
        boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                     aws_access_key_id="bench", aws_secret_access_key="bench"
                     ).create_bucket(Bucket=BUCKET)
        yield env


def throughput(url: str, blob_bytes: int, work: Path) -> tuple[float, float]:
    """(upload, download) bytes/s of one blob through the checkpoint store."""
    store = Store(url)
    chunk = os.urandom(1 << 20)

    def produce(f) -> None:  # type: ignore[no-untyped-def]
        for _ in range(blob_bytes // len(chunk)):
            f.write(chunk)

    started = time.perf_counter()
    store.write_stream("blob.bin", produce)
    up = blob_bytes / (time.perf_counter() - started)
    started = time.perf_counter()
    store.local_copy("blob.bin", work)
    down = blob_bytes / (time.perf_counter() - started)
    store.remove("blob.bin")
    return up, down


def bench_target(name: str, target_of: dict[str, str | None], env: dict[str, str],
                 args: argparse.Namespace) -> None:
    modes = {"none": (None, True), "sync": ("sync", False), "async": ("async", True)}
    times: dict[str, list[float]] = {m: [] for m in modes}
    shares: dict[str, list[float]] = {m: [] for m in modes}
    for repeat in range(args.repeats):
        for mode, (key, asynchronous) in modes.items():
            target = None if key is None else f"{target_of[key]}/r{repeat}"
            per_rank = spawn_ranks(_worker, 2, env, target, args.steps, args.interval,
                                 asynchronous, timeout_seconds=1800)
            step, _ = measure(*per_rank[0], args.warmup)
            times[mode].append(step)
            shares[mode].append(max(measure(*r, args.warmup)[1] for r in per_rank))
    base = statistics.median(times["none"])
    print(f"{name}: step {base * 1e3:.1f} ms without checkpoints "
          f"(runs: {' '.join(f'{t * 1e3:.1f}' for t in times['none'])})")
    for mode in ("sync", "async"):
        med = statistics.median(times[mode])
        print(f"  {mode:5s} every {args.interval} steps: {med * 1e3:.1f} ms/step, end-to-end "
              f"{(med / base - 1) * 100:+.1f} % (runs: "
              f"{' '.join(f'{t * 1e3:.1f}' for t in times[mode])}); training thread in "
              f"checkpoint calls {statistics.median(shares[mode]) * 100:.1f} % of the time")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--interval", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--targets", default="local,s3")
    parser.add_argument("--blob-mib", type=int, default=64)
    args = parser.parse_args()
    targets = args.targets.split(",")
    with tempfile.TemporaryDirectory(prefix="cephalo-bench-ckpt-") as tmp:
        work = Path(tmp)
        from cephalo.trainer.models import build_model

        numel = sum(p.numel() for p in build_model(job(1, 1).model.resolve()).parameters())
        shard_bytes = 12 * numel // 2  # fp32 weights + two Adam moments, split over 2 ranks
        print(f"gpt-small on 2 CPU ranks, global batch 24; about {shard_bytes / 2**20:.1f} "
              f"MiB of checkpoint per rank; {args.steps} steps, {args.repeats} repeats")
        if "local" in targets:
            bench_target("local folder", {"sync": str(work / "sync"),
                                          "async": str(work / "async")}, {}, args)
        if "s3" in targets:
            with moto_s3() as env:
                os.environ.update(env)
                up, down = throughput(f"s3://{BUCKET}/throughput", args.blob_mib << 20, work)
                print(f"moto S3 over HTTP: upload {up / 1e6:.0f} MB/s, download "
                      f"{down / 1e6:.0f} MB/s ({args.blob_mib} MiB blob)")
                bench_target("moto S3", {"sync": f"s3://{BUCKET}/sync",
                                         "async": f"s3://{BUCKET}/async"}, env, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
