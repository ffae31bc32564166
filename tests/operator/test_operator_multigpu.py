"""Issue 12, item 5: several GPUs per pod (pure parts and the pod launcher).

A pod of k ranks requests `nvidia.com/gpu: k` and runs k trainer processes with consecutive
global ranks, LOCAL_RANK 0..k-1 (the GPU each drives); the plan still gives every rank its
own batch and shard. Checked against kubernetes-validate (the real Pod schema), the
trainer's own environment check (plan and job files), Kueue's and Volcano's documented
group counts (pods, not ranks), and real child processes of the launcher.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kube_fixtures import job_body
from pydantic import ValidationError

from cephalo.api import Plan, parse_job
from cephalo.api import trainer_env as names
from cephalo.api.trainer_env import EnvError, pod_process_environ, read_env
from cephalo.operator.gang import group_name, render_pod_group
from cephalo.operator.podspec import (
    POD_RANKS_KEY,
    pack_ranks,
    pod_groups,
    pods_fit,
    with_pod_ranks,
)
from cephalo.operator.render import config_hash, owner_reference, rank_pod_names, render
from cephalo.trainer.__main__ import run_pod

GOLDEN = Path(__file__).parent / "golden"
UID = "0d5c2b1e-0000-4000-8000-000000000012"
GPU = "nvidia.com/gpu"


def _plan(pools: list[str], batch: int = 8) -> Plan:
    """A hand-written plan (the golden file must not move when the planner improves)."""
    n = len(pools)
    ratios = [1 / n] * (n - 1)
    ratios.append(1 - sum(ratios))
    return Plan.model_validate({
        "global_batch_size": batch * n, "world_size": n, "predicted_step_seconds": 0.5,
        "ranks": [{"rank": i, "gpu": p.split("-", 1)[1], "pool": p, "batch_size": batch,
                   "micro_batch_size": batch // 2, "num_micro_batches": 2,
                   "shard_ratio": ratios[i]} for i, p in enumerate(pools)]})


A10G, T4 = "NVIDIA-A10G", "Tesla-T4"
SIX = [A10G] * 4 + [T4] * 2


def _job(**spec):
    return parse_job(job_body("gpt", uid=UID, ranksPerPod=0, globalBatchSize=48, **spec))


@pytest.mark.parametrize(("pools", "free", "cap", "sizes"), [
    (SIX, {A10G: [4], T4: [2]}, 0, [4, 2]),  # one pod per node
    (SIX, {A10G: [4], T4: [1, 1]}, 0, [4, 1, 1]),  # T4 on two nodes: two pods
    (SIX, {A10G: [2, 3], T4: [2]}, 0, [3, 1, 2]),  # the fullest node first
    (SIX, {A10G: [4], T4: [2]}, 2, [2, 2, 2]),  # at most 2 a pod
    (SIX, {A10G: [4], T4: [2]}, 1, [1] * 6),
    (SIX, {A10G: [8]}, 0, [4, 1, 1]),  # a pool not seen: one rank a pod
    (SIX, {A10G: [3], T4: [2]}, 0, [3, 1, 2]),  # more ranks than free GPUs seen
    ([A10G, A10G, T4, A10G, A10G], {A10G: [4], T4: [1]}, 0, [2, 1, 2]),  # runs, not pools
    ([A10G, A10G, T4, A10G, A10G], {A10G: [3], T4: [1]}, 0, [2, 1, 1, 1]),
])
def test_ranks_are_packed_per_pool_onto_the_nodes_free_gpus(pools, free, cap, sizes) -> None:
    plan = _plan(pools)
    assert pack_ranks(plan, free, cap) == sizes
    groups = pod_groups(with_pod_ranks(plan, sizes))
    assert [len(g) for g in groups] == sizes
    assert [r.rank for g in groups for r in g] == list(range(len(pools)))  # consecutive
    assert all(len({r.pool for r in g}) == 1 for g in groups)  # a pod is on one pool's node


def test_the_grouping_travels_in_the_plan_and_bad_ones_fall_back() -> None:
    plan = _plan(SIX)
    assert with_pod_ranks(plan, [1] * 6) == plan  # nothing recorded: same plan, same hash
    packed = with_pod_ranks(plan, [4, 2])
    assert json.loads(packed.to_json())[POD_RANKS_KEY] == [4, 2]
    assert Plan.model_validate_json(packed.to_json()) == packed  # the ConfigMap round trip
    assert config_hash(_job(), packed) != config_hash(_job(), plan)  # new grouping: restart
    for bad in ([3, 3], [4, 1], [6], [4, 0, 2]):  # mixes pools, wrong sum, a zero
        broken = Plan.model_validate({**plan.model_dump(mode="json"), POD_RANKS_KEY: bad})
        assert [len(g) for g in pod_groups(broken)] == [1] * 6, bad
    with pytest.raises(ValidationError):  # not a list: the plan itself is refused (re-plan)
        Plan.model_validate({**plan.model_dump(mode="json"), POD_RANKS_KEY: "4,2"})
    assert rank_pod_names(_job(), packed) == {0: "gpt-rank-0", 1: "gpt-rank-0", 2: "gpt-rank-0",
                                              3: "gpt-rank-0", 4: "gpt-rank-4", 5: "gpt-rank-4"}


def test_a_pool_whose_nodes_no_longer_hold_the_pods_is_lost() -> None:
    """The re-plan check: 4 A10Gs on two 2-GPU nodes hold as many GPUs as one 4-GPU node,
    but not a pod of 4 ranks (it would stay Pending)."""
    plan = with_pod_ranks(_plan(SIX), [4, 1, 1])
    assert pods_fit(plan, {A10G: [4], T4: [1, 1]}) == []
    assert pods_fit(plan, {A10G: [2, 8]}) == []  # one-rank pods are plan_fits' business
    assert pods_fit(plan, {A10G: [2, 2], T4: [2]}) == [
        "NVIDIA-A10G: a pod of 4 ranks fits on no node (GPUs per node [2, 2])"]
    two_fours = with_pod_ranks(_plan([A10G] * 8), [4, 4])
    assert pods_fit(two_fours, {A10G: [8]}) == []
    assert pods_fit(two_fours, {A10G: [4, 3]}) != []  # the second 4 has nowhere to go
    assert pods_fit(_plan(SIX), {}) == []


def test_multi_gpu_pods_match_golden_and_validate() -> None:
    job, plan = _job(), with_pod_ranks(_plan(SIX), [4, 2])
    objects = render(job, plan)
    pods = objects[2:]
    text = yaml.safe_dump_all(pods, sort_keys=True)
    path = GOLDEN / "render-multigpu.yaml"
    if os.environ.get("CEPHALO_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), "render-multigpu.yaml differs (CEPHALO_UPDATE_GOLDEN=1)"
    for obj in objects:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    assert [p["metadata"]["name"] for p in pods] == ["gpt-rank-0", "gpt-rank-4"]
    for pod, (first, count, pool) in zip(pods, [(0, 4, A10G), (4, 2, T4)], strict=True):
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["requests"][GPU] == count
        assert container["resources"]["limits"][GPU] == count
        assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": pool}
        labels = pod["metadata"]["labels"]
        assert labels["cephalo.dev/rank"] == str(first)
        assert labels["cephalo.dev/ranks-per-pod"] == str(count)
        assert pod["spec"]["hostname"] == pod["metadata"]["name"]  # rank 0's is MASTER_ADDR


def test_each_process_of_a_pod_passes_the_trainers_own_checks(tmp_path: Path) -> None:
    """The pod's env → each process's env (the contract's one writer) → the trainer's full
    check against the plan and job files the pod mounts."""
    from cephalo.trainer.env import read_env as trainer_read_env

    job, plan = _job(), with_pod_ranks(_plan(SIX), [4, 2])
    objects = render(job, plan)
    for key, text in objects[0]["data"].items():  # the plan ConfigMap, as mounted
        (tmp_path / key).write_text(text)
    seen = []
    for pod in objects[2:]:
        env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]
               if "value" in e}
        pod_vars = read_env(env)
        env[names.JOB], env[names.PLAN] = str(tmp_path / "job.yaml"), str(tmp_path / "plan.json")
        assert pod_vars.ranks_per_pod is not None and pod_vars.batch_size is None
        for local in range(pod_vars.ranks_per_pod):
            process = pod_process_environ(env, local)
            assert names.RANKS_PER_POD not in process
            got = trainer_read_env(process)
            assert (got.rank, got.local_rank, got.world_size) == (
                (pod_vars.rank or 0) + local, local, 6)
            # its own batch and shard, from the plan (the GPU it drives: LOCAL_RANK)
            assert got.plan.ranks[got.rank].batch_size == plan.ranks[got.rank].batch_size
            assert got.metrics_port == pod_vars.metrics_port  # + LOCAL_RANK when it binds
            seen.append(got.rank)
    assert seen == list(range(6))
    env = {names.RANK: "4", names.WORLD_SIZE: "6", names.RANKS_PER_POD: "3"}
    with pytest.raises(EnvError, match="runs past WORLD_SIZE=6"):
        read_env(env)
    with pytest.raises(EnvError, match="outside the pod's 2 rank"):
        pod_process_environ({**env, names.RANKS_PER_POD: "2"}, 2)


def test_gangs_count_pods_not_ranks() -> None:
    """Kueue's pod-group-total-count and Volcano's minMember/minTaskMember count pods (their
    docs: the number of pods in the group); minResources counts every GPU."""
    plan = with_pod_ranks(_plan(SIX), [4, 1, 1])
    kueue_body = job_body("gpt", uid=UID, ranksPerPod=0, globalBatchSize=48)
    kueue_body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    kueue = parse_job(kueue_body)
    pods = render(kueue, plan)[2:]
    assert {p["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"]
            for p in pods} == {"3"}
    volcano = _job(schedulingPolicy={"schedulerName": "volcano"})
    pods = render(volcano, plan)[2:]
    group = group_name("gpt", 0, config_hash(volcano, plan))
    pod_group = render_pod_group(volcano, pods, group=group, owner=owner_reference(volcano))
    assert pod_group is not None
    assert pod_group["spec"]["minMember"] == 3
    assert pod_group["spec"]["minTaskMember"] == {"nvidia-a10g": 1, "tesla-t4": 2}
    assert pod_group["spec"]["minResources"][GPU] == "6"


CHILD = ("import json, os, sys, time; rank = int(os.environ['RANK']); "
         "open(os.path.join(sys.argv[1], str(rank)), 'w').write(json.dumps(dict(os.environ))); "
         "time.sleep(float(sys.argv[2]) if rank == int(sys.argv[3]) else 30)")


def _pod_env(first: int, count: int) -> dict[str, str]:
    return {**os.environ, names.RANK: str(first), names.WORLD_SIZE: "8",
            names.LOCAL_RANK: "0", names.RANKS_PER_POD: str(count)}


def test_launcher_starts_one_process_per_gpu_and_stops_them_on_a_failure(
        tmp_path: Path) -> None:
    """Real processes: 3 ranks from rank 4; rank 5 exits 7 after 0.5 s, the others (which
    would wait 30 s in a collective) are stopped and the pod exits with rank 5's code."""
    script = [sys.executable, "-c", CHILD + "; sys.exit(7)", str(tmp_path), "0.5", "5"]
    assert run_pod(_pod_env(4, 3), 3, script, grace_seconds=5.0) == 7
    envs = {int(p.name): json.loads(p.read_text()) for p in tmp_path.iterdir()}
    assert sorted(envs) == [4, 5, 6]
    for rank, env in envs.items():
        assert env[names.LOCAL_RANK] == str(rank - 4) and names.RANKS_PER_POD not in env
        assert read_env(env).rank == rank
    ok = tmp_path / "ok"
    ok.mkdir()
    fast = [sys.executable, "-c", CHILD.replace("else 30", "else 0"), str(ok), "0", "0"]
    assert run_pod(_pod_env(0, 2), 2, fast) == 0
    assert sorted(p.name for p in ok.iterdir()) == ["0", "1"]


def test_one_rank_process_refuses_a_whole_pods_environment(tmp_path: Path) -> None:
    """A rank started directly (not through the pod launcher) with RANKS_PER_POD > 1 would
    train as the first rank only, leaving the others' GPUs idle and the gang hung."""
    from cephalo.trainer.env import read_env as trainer_read_env

    objects = render(_job(), with_pod_ranks(_plan(SIX), [4, 2]))
    env = {e["name"]: e["value"] for e in objects[2]["spec"]["containers"][0]["env"]
               if "value" in e}
    with pytest.raises(EnvError, match="CEPHALO_RANKS_PER_POD=4: a pod of several ranks"):
        trainer_read_env(env)
    ports = [p["containerPort"] for p in objects[2]["spec"]["containers"][0]["ports"]]
    metrics = read_env(env).metrics_port or 0
    assert ports[1:] == [metrics + i for i in range(4)]  # every process's /metrics declared


TINY = {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob", "metadata": {"name": "t"},
        "spec": {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 8,
                 "training": {"steps": 2}, "checkpoint": {"intervalSteps": 1}}}


@pytest.mark.slow
def test_a_pod_of_two_ranks_trains_with_the_real_trainer(tmp_path: Path) -> None:
    """`python -m cephalo.trainer` with the pod's environment (RANK 0, RANKS_PER_POD 2) runs
    ranks 0 and 1 as two processes that form one gloo group and train to the end."""
    import subprocess

    from cephalo.trainer.spawn import free_port

    plan = {"global_batch_size": 8, "world_size": 2, "ranks": [
        {"rank": 0, "batch_size": 5, "micro_batch_size": 5, "num_micro_batches": 1,
         "shard_ratio": 0.6},
        {"rank": 1, "batch_size": 3, "micro_batch_size": 3, "num_micro_batches": 1,
         "shard_ratio": 0.4}]}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(TINY))
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, names.RANK: "0", names.WORLD_SIZE: "2", names.LOCAL_RANK: "0",
           names.RANKS_PER_POD: "2", names.MASTER_ADDR: "127.0.0.1",
           names.MASTER_PORT: str(free_port()), names.JOB: str(tmp_path / "job.yaml"),
           names.PLAN: str(tmp_path / "plan.json"),
           names.CHECKPOINT_DIR: str(tmp_path / "ckpt"), names.NUM_THREADS: "1"}
    # Generous: two ranks of a tiny model take seconds, but a CI run at load 10 on 2 cores
    # passed 240 s (import, rendezvous and two steps); only a hang should fail here.
    done = subprocess.run([sys.executable, "-m", "cephalo.trainer"], env=env, timeout=600,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps and max(s.get("step", 0) for s in steps) == 2  # rank 0 of the two trained


def test_a_stopping_pod_lets_every_rank_finish_its_checkpoint(tmp_path: Path) -> None:
    """SIGTERM to the pod reaches every process; one that leaves at once (143) does not cut
    short another still writing its checkpoint (2 s here, past the 0.5 s failure grace)."""
    import signal
    import threading

    child = ("import os, signal, sys, time; rank = int(os.environ['RANK']); "
             "signal.signal(signal.SIGTERM, lambda *a: None); "  # a flag, as the trainer
             "open(os.path.join(sys.argv[1], str(rank)), 'w').close(); "
             "time.sleep(3 + (2 if rank == 1 else 0)); "  # the checkpoint write
             "open(os.path.join(sys.argv[1], f'saved-{rank}'), 'w').close(); sys.exit(143)")
    script = [sys.executable, "-c", child, str(tmp_path)]
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM))
    previous = signal.getsignal(signal.SIGTERM)
    timer.start()
    try:
        assert run_pod(_pod_env(0, 2), 2, script, grace_seconds=0.5) == 143
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, previous)
    assert {p.name for p in tmp_path.iterdir()} == {"0", "1", "saved-0", "saved-1"}
