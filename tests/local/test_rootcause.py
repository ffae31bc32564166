"""Which rank `cephalo run` blames (issue 13: a disk-full error on rank 0 was reported as
"rank 1 failed: Connection closed by peer"). The log texts are what torch 2.x and gloo print."""

from __future__ import annotations

from cephalo.rootcause import RankFailure, describe, error_line, root_cause

# Rank 1's log when rank 0 died mid-step (captured from a real 2-rank CPU run).
PEER_CLOSED = """\
[rank1]:   File "/work/main/trainer/collectives.py", line 47, in wait
[rank1]:     w.wait()
[rank1]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] \
Connection closed by peer [127.0.0.1]:47021. This is typically caused by a remote worker \
crashing. Check the logs of the remote worker before reporting an error. GLHF!
"""
DISK_FULL = """\
step 20/400 loss 5.1 lr 1.00e-02 grad-norm 1.0 | 90.0 samples/s | step 0.060 s
[rank0]:   File "/work/main/trainer/checkpoint.py", line 88, in save
[rank0]:     torch.save(state, tmp)
[rank0]: OSError: [Errno 28] No space left on device
"""
NCCL_TIMEOUT = """\
[rank2]:[E ProcessGroupNCCL.cpp:563] [Rank 2] Watchdog caught collective operation timeout: \
WorkNCCL(SeqNum=88, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.
torch.distributed.DistBackendError: NCCL communicator was aborted on rank 2.
"""


def test_error_line_is_the_last_exception_line() -> None:
    assert error_line(DISK_FULL) == "OSError: [Errno 28] No space left on device"
    assert error_line(PEER_CLOSED).startswith("RuntimeError: [/__w/pytorch")
    assert error_line("step 1/4 loss 5.5\nstep 2/4 loss 5.4\n") is None
    assert error_line("cephalo trainer (rank 1): error: CEPHALO_PLAN x.json: no such file") \
        == "cephalo trainer (rank 1): error: CEPHALO_PLAN x.json: no such file"


def test_the_peer_that_noticed_first_is_not_blamed() -> None:
    echo, cause = RankFailure(1, 1, PEER_CLOSED), RankFailure(0, 1, DISK_FULL)
    assert root_cause([echo, cause]) is cause
    # Still running (stopped by the launcher) but its log already shows the real error.
    assert root_cause([echo, RankFailure(0, None, DISK_FULL)]).rank == 0


def test_nccl_timeouts_are_echoes_and_a_killed_rank_is_a_cause() -> None:
    killed = RankFailure(3, -9, "step 7/100 loss 4.2\n")
    assert root_cause([RankFailure(2, 1, NCCL_TIMEOUT), killed]) is killed
    assert "SIGKILL" in describe(killed) and "out-of-memory" in describe(killed)


def test_when_every_failure_is_an_echo_the_first_stands() -> None:
    first, second = RankFailure(1, 1, PEER_CLOSED), RankFailure(0, 1, NCCL_TIMEOUT)
    assert root_cause([first, second, RankFailure(2, None, "step 3/9\n")]) is first
    # A rank still running with a clean log is never blamed over one that failed.
    assert root_cause([first, RankFailure(0, None, "step 3/9\n")]) is first


def test_first_real_error_wins_over_later_ones() -> None:
    early = RankFailure(2, 1, "[rank2]: ValueError: bad batch\n")
    assert root_cause([early, RankFailure(0, 1, DISK_FULL)]) is early
