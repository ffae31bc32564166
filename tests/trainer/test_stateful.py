"""The engine and its optimizer are torch `Stateful`s: torch.distributed.checkpoint (which we
did not write) saves and loads them through `state_dict()` / `load_state_dict()`, and a
restored engine continues exactly where the saved one was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from cephalo.api.job import DataSpec, SyntheticData, TrainingSpec
from cephalo.api.models import preset
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Engine, Layout

CONFIG = preset("gpt-tiny")
TRAINING = TrainingSpec(steps=10, learning_rate=1e-2, weight_decay=0.1, seed=3)
BATCH = 4


def _engine(seed: int = 3) -> Engine:
    layout = Layout(batch_sizes=[BATCH], micro_batch_sizes=[2], shard_ratios=[1.0])
    training = TRAINING.model_copy(update={"seed": seed})
    return Engine(CONFIG, training, layout, standalone=True)


def _train(engine: Engine, steps: int) -> None:
    data = DataSource(CONFIG, DataSpec(synthetic=SyntheticData()), seed=0)
    for _ in range(steps):
        engine.step(data.micro_batches(engine.step_count, 0, BATCH, 2))


def _flat(engine: Engine) -> torch.Tensor:
    opt = engine.state_dict()["optimizer"]
    return torch.cat([t.reshape(-1) for key in ("param", "exp_avg", "exp_avg_sq")
                      for t in opt[key]])  # type: ignore[literal-required]


def test_engine_and_optimizer_follow_torchs_stateful_protocol() -> None:
    engine = _engine()
    assert all(isinstance(part, Stateful) for part in (engine, engine.optimizer))
    state = engine.state_dict()
    assert state["step_count"] == 0 and state["optimizer"]["num_steps"] == 0
    assert [t.numel() for t in state["optimizer"]["param"]] == [u.numel for u in engine.units]
    # Live tensors, not copies: a loader fills them in place (what DCP does).
    assert state["optimizer"]["param"][0].data_ptr() == engine.master_shards[0].data_ptr()


def test_load_state_dict_continues_exactly_where_the_saved_engine_was() -> None:
    saved = _engine()
    _train(saved, 2)
    copy = {"step_count": saved.step_count, "optimizer": {
        key: ([t.clone() for t in value] if isinstance(value, list) else value)
        for key, value in saved.optimizer.state_dict().items()}}
    resumed = _engine(seed=99)  # different initial weights: all must come from the state
    assert not torch.equal(_flat(resumed), _flat(saved))
    resumed.load_state_dict(copy)  # type: ignore[arg-type]
    assert resumed.step_count == 2 and resumed.optimizer.num_steps == 2
    assert torch.equal(_flat(resumed), _flat(saved))
    _train(saved, 2)
    _train(resumed, 2)
    # Same data (step-indexed), same Adam bias correction: bit-identical weights and moments.
    assert torch.equal(_flat(resumed), _flat(saved))


def test_load_state_dict_refuses_another_layout() -> None:
    engine = _engine()
    state = engine.state_dict()
    bad = {**state["optimizer"], "param": [t[:-1] for t in state["optimizer"]["param"]]}
    with pytest.raises(ValueError, match="param shard of shape"):
        engine.optimizer.load_state_dict(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 exp_avg shards"):
        engine.optimizer.load_state_dict(
            {**state["optimizer"], "exp_avg": state["optimizer"]["exp_avg"][:2]})


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: intended
def test_torch_distributed_checkpoint_round_trips_the_engine(tmp_path: Path) -> None:
    """DCP saves a Stateful by calling state_dict(), loads by filling state_dict()'s tensors
    in place and then calling load_state_dict(): the protocol torchtitan's trainer uses."""
    saved = _engine()
    _train(saved, 3)
    dcp.save({"engine": saved}, checkpoint_id=str(tmp_path / "dcp"))
    resumed = _engine(seed=7)
    dcp.load({"engine": resumed}, checkpoint_id=str(tmp_path / "dcp"))
    assert resumed.step_count == 3 and resumed.optimizer.num_steps == 3
    assert torch.equal(_flat(resumed), _flat(saved))
