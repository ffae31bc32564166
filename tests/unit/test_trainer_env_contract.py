"""The trainer environment contract (cephalo.api.trainer_env): what its one writer emits, its
one reader parses back unchanged, for the operator's rank pods and `cephalo run`'s local
ranks alike; malformed values are one-line errors; and no other module spells a contract
variable name (a second spelling is how a writer and a reader drift apart)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import yaml

from cephalo.api import CephaloJob, Plan
from cephalo.api import trainer_env as names
from cephalo.api.trainer_env import EnvError, TrainerVars, read_env, to_environ
from cephalo.errors import CephaloError
from cephalo.local.devices import LocalDevice
from cephalo.local.ranks import RankEnv, rank_environment
from cephalo.operator.render import render, render_profiler_pod

ROOT = Path(__file__).resolve().parents[2]
CONTRACT_MODULE = ROOT / "src" / "cephalo" / "api" / "trainer_env.py"
SOURCE_FOLDERS = ("src/cephalo", "operator", "trainer")

JOB = {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
       "metadata": {"name": "envtest", "namespace": "team", "uid": "u-1"},
       "spec": {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 8,
                "training": {"steps": 3}, "checkpoint": {"claimName": "ckpt"}}}
PLAN = {"global_batch_size": 8, "world_size": 2, "ranks": [
    {"rank": 0, "gpu": "NVIDIA-A10G", "batch_size": 5, "micro_batch_size": 5,
     "num_micro_batches": 1, "shard_ratio": 0.1 + 0.2 + 0.3},  # 0.6000000000000001
    {"rank": 1, "gpu": "NVIDIA-A10G", "batch_size": 3, "micro_batch_size": 1,
     "num_micro_batches": 3, "shard_ratio": 1 - (0.1 + 0.2 + 0.3)}]}


def test_every_field_round_trips_through_the_reader() -> None:
    full = TrainerVars(
        rank=1, world_size=3, local_rank=0, master_addr="r-0.svc", master_port=29500,
        job="/etc/cephalo/job.yaml", plan="/etc/cephalo/plan.json", batch_size=7,
        micro_batch_size=7, num_micro_batches=1, shard_ratio=1 / 3, checkpoint_dir="s3://b/p",
        metrics_port=9400, restart_attempt=2, metrics_file="/tmp/m.jsonl", num_threads=4,
        time_dilation=2.5, memory_limit_bytes=10**9, collective_timeout_seconds=90.0,
        stop_after_step=5, data_cache="/cache/tokens", tokenize_workers=4, ranks_per_pod=2,
        pod_uid="0b4e-uid", metrics_address="127.0.0.1",
        termination_log="/dev/termination-log", link_bytes_per_second=1.25e6,
        time_dilation_from_step=3)
    environ = to_environ(full)
    assert set(environ) == names.ALL_NAMES and all(isinstance(v, str) for v in environ.values())
    assert read_env(environ) == full
    assert float(environ[names.SHARD_RATIO]) == 1 / 3  # every bit of the float survives
    # Unset stays unset; an empty checkpoint directory ("keep none") is a value, kept.
    assert to_environ(TrainerVars()) == {} and read_env({}) == TrainerVars()
    no_ckpt = TrainerVars(job="/j.yaml", checkpoint_dir="")
    assert to_environ(no_ckpt) == {names.JOB: "/j.yaml", names.CHECKPOINT_DIR: ""}
    assert read_env(to_environ(no_ckpt)) == no_ckpt
    assert names.missing(no_ckpt) == [names.RANK, names.WORLD_SIZE, names.MASTER_ADDR,
                                      names.MASTER_PORT, names.PLAN]


def test_operator_rank_pods_read_back_as_the_plan() -> None:
    job, plan = CephaloJob.model_validate(JOB), Plan.model_validate(PLAN)
    pods = [o for o in render(job, plan) if o["kind"] == "Pod"]
    for rank, pod in enumerate(pods):
        entries = pod["spec"]["containers"][0]["env"]
        env = {e["name"]: e["value"] for e in entries if "value" in e}
        # The pod's own uid only exists once created: the downward API, nothing else.
        assert {e["name"]: e["valueFrom"] for e in entries if "value" not in e} == {
            names.POD_UID: {"fieldRef": {"fieldPath": "metadata.uid"}}}
        got, mine = read_env({**env, names.POD_UID: "uid-1"}), plan.ranks[rank]
        assert got.pod_uid == "uid-1"
        assert names.missing(got) == []
        assert (got.rank, got.world_size, got.local_rank) == (rank, 2, 0)
        assert (got.batch_size, got.micro_batch_size, got.num_micro_batches, got.shard_ratio) \
            == (mine.batch_size, mine.micro_batch_size, mine.num_micro_batches,
                mine.shard_ratio)  # exact: the trainer compares them with the plan file
        assert got.checkpoint_dir and got.restart_attempt == 0 and got.metrics_port
        assert got.master_addr and got.master_addr.startswith(pod["metadata"]["name"][:-1])
    profiler = render_profiler_pod(job, "NVIDIA-A10G", 0)
    env = {e["name"]: e["value"] for e in profiler["spec"]["containers"][0]["env"]}
    assert read_env(env) == TrainerVars(job="/etc/cephalo/job.yaml")


def test_local_ranks_pass_the_trainers_own_checks(tmp_path: Path) -> None:
    """`cephalo run`'s environment, read by the trainer's full check (plan and job files)."""
    from cephalo.trainer.env import read_env as trainer_read_env

    (tmp_path / "job.yaml").write_text(yaml.safe_dump(JOB))
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    plan = Plan.model_validate(PLAN)
    ranks = [RankEnv(LocalDevice("cpu", 0, "cpu"), dilation=2.0, memory_limit_bytes=10**8),
             RankEnv(LocalDevice("cpu", 1, "cpu"))]
    for rank in range(2):
        env = rank_environment(rank, plan, ranks, tmp_path, tmp_path / "job.yaml",
                               tmp_path / "plan.json", 29511, 1, stop_after_step=2)
        got = trainer_read_env(env)
        assert (got.rank, got.world_size, got.local_rank, got.stop_after_step) == (rank, 2,
                                                                                  rank, 2)
        assert got.checkpoint_dir == str(tmp_path / "checkpoints")
        assert got.metrics_file == tmp_path / "metrics.jsonl" and got.num_threads == 1
        assert (got.time_dilation, got.memory_limit_bytes) == \
            ((2.0, 10**8) if rank == 0 else (1.0, None))
        assert env["CUDA_VISIBLE_DEVICES"] == ""  # a CPU rank must not grab a GPU


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "x"}, "RANK='x' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 must be in [0, WORLD_SIZE=2)"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a port"),
    ({"CEPHALO_METRICS_PORT": "-1"}, "CEPHALO_METRICS_PORT=-1 is not a port"),
    ({"CEPHALO_SHARD_RATIO": "half"}, "CEPHALO_SHARD_RATIO='half' is not a number"),
    ({"CEPHALO_SHARD_RATIO": "nan"}, "CEPHALO_SHARD_RATIO=nan must be in [0, 1]"),
    ({"CEPHALO_TIME_DILATION": "inf"}, "CEPHALO_TIME_DILATION=inf must be >= 1"),
    ({"CEPHALO_LINK_BYTES_PER_SECOND": "0"},
     "CEPHALO_LINK_BYTES_PER_SECOND=0.0 must be a bandwidth"),
    ({"CEPHALO_COLLECTIVE_TIMEOUT_SECONDS": "nan"}, "must be a number of seconds > 0"),
    ({"CEPHALO_NUM_THREADS": "-2"}, "CEPHALO_NUM_THREADS=-2 must be >= 0"),
    ({"CEPHALO_BATCH_SIZE": "3.5"}, "CEPHALO_BATCH_SIZE='3.5' is not an integer"),
])
def test_malformed_values_are_one_line_user_errors(env: dict[str, str], message: str) -> None:
    with pytest.raises(EnvError) as err:
        read_env(env)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert isinstance(err.value, CephaloError) and isinstance(err.value, ValueError)


def _string_literals(path: Path) -> list[tuple[int, str]]:
    """Every string constant in the code, f-string parts included, and every keyword
    argument's name; docstrings and other bare string statements are documentation, like
    comments."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    documentation = {id(node.value) for node in ast.walk(tree)
                     if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    strings = [(node.lineno, node.value) for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str)
               and id(node) not in documentation]
    # A keyword argument spells a name too: os.environ.update(MASTER_ADDR=...).
    keywords = [(node.value.lineno, node.arg) for node in ast.walk(tree)
                if isinstance(node, ast.keyword) and node.arg is not None]
    return sorted(strings + keywords)


def test_no_module_but_the_contract_spells_a_contract_name() -> None:
    """Comments may name a variable for the reader; code goes through the constants. In the
    trainer, which only reads the environment, no CEPHALO_* literal at all is allowed (a new
    variable belongs in the contract). Other CEPHALO_* names, e.g. the operator's own
    settings (cephalo.operator.config), are another contract."""
    contract = sorted(n for n in names.ALL_NAMES if n.startswith("CEPHALO_"))
    contract += [names.MASTER_ADDR, names.MASTER_PORT]
    spelled = re.compile(r"\b(" + "|".join(contract) + r")\b")
    any_cephalo = re.compile(r"\bCEPHALO_[A-Z0-9_]+")
    offenders = []
    files = [p for folder in SOURCE_FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 50 and CONTRACT_MODULE in files
    for path in files:
        if path == CONTRACT_MODULE:
            continue
        in_trainer = path.is_relative_to(ROOT / "trainer")
        for line, text in _string_literals(path):
            if spelled.search(text) or (in_trainer and any_cephalo.search(text)):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {text[:60]}")
    assert offenders == [], "use cephalo.api.trainer_env's constants:\n" + "\n".join(offenders)


def test_the_check_above_can_fail(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text('"""CEPHALO_PLAN in a docstring is fine"""\n# and in a comment\n'
                      'x = f"{y} CEPHALO_PLAN"\nz = "CEPHALO_JOB"\nd = dict(MASTER_ADDR=x)\n')
    assert _string_literals(sample) == [(3, " CEPHALO_PLAN"), (4, "CEPHALO_JOB"),
                                        (5, "MASTER_ADDR")]
