"""Which failed rank the job status names (issue 13: a disk-full error on rank 0 showed up as
"rank 1 failed: Connection closed by peer"). The termination messages are what the trainer
pods leave (terminationMessagePolicy FallbackToLogsOnError: the log tail)."""

from __future__ import annotations

from cephalo.api.plan import RankPlan
from cephalo.operator.status import PodState, failure_summary
from cephalo.operator.training import blame

PEER_CLOSED = ("[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] "
               "Connection closed by peer [10.0.3.7]:47021. This is typically caused by a "
               "remote worker crashing.")
DISK_FULL = ("step 20/400 loss 5.1\n[rank0]:   File \"/app/trainer/storage.py\", line 88\n"
             "[rank0]: OSError: [Errno 28] No space left on device")


def _rank(i: int) -> RankPlan:
    return RankPlan(rank=i, gpu="A10G", pool="NVIDIA-A10G", batch_size=4, micro_batch_size=4,
                    num_micro_batches=1, shard_ratio=0.5)


def _failed(i: int, message: str, finished_at: str | None, exit_code: int | None = 1
            ) -> tuple[RankPlan, PodState]:
    return _rank(i), PodState(name=f"job-rank-{i}", phase="Failed", deleting=False,
                              exit_code=exit_code, reason="Error", message=message,
                              pod_ip=None, finished_at=finished_at)


def test_the_rank_with_its_own_error_is_blamed_not_the_peer_that_finished_first() -> None:
    peer = _failed(1, PEER_CLOSED, "2026-12-01T08:00:01Z")
    disk = _failed(0, DISK_FULL, "2026-12-01T08:00:02Z")
    rank, state = blame([peer, disk])
    assert rank.rank == 0
    assert "No space left on device" in failure_summary(rank.rank, "NVIDIA-A10G", state)


def test_of_two_real_errors_the_earlier_one_is_blamed() -> None:
    late = _failed(0, "[rank0]: MemoryError", "2026-12-01T08:00:09Z")
    early = _failed(2, "[rank2]: ValueError: bad batch", "2026-12-01T08:00:03Z")
    assert blame([late, early])[0].rank == 2


def test_when_every_rank_only_echoes_a_peer_the_earliest_stands() -> None:
    a = _failed(3, PEER_CLOSED, "2026-12-01T08:00:05Z")
    b = _failed(1, PEER_CLOSED, "2026-12-01T08:00:04Z")
    assert blame([a, b])[0].rank == 1


def test_a_rank_killed_without_a_message_is_a_cause() -> None:
    peer = _failed(1, PEER_CLOSED, "2026-12-01T08:00:01Z")
    oom = _failed(0, "", "2026-12-01T08:00:02Z", exit_code=137)
    assert blame([peer, oom])[0].rank == 0
