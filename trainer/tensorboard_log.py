"""Rank 0's TensorBoard event files (`spec.tracking.tensorboard`), written with PyTorch's
own SummaryWriter (which needs the `tensorboard` package: the `tracking` extra).

They go into `tensorboard/` next to the progress file (the run directory of `cephalo run`,
the checkpoint volume's job folder in a pod), so `tensorboard --logdir <that folder>` shows
the run; a gang restart or a resume appends new event files there, which TensorBoard reads
as one run. Tracking never stops training: without the package or a local folder the
trainer says so once and trains on.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from cephalo.api.plan import Plan
from cephalo.api.tracking import TrackingSpec

FOLDER = "tensorboard"
# progress-record key -> TensorBoard tag (grouped as TensorBoard shows them: by prefix)
SCALARS = {"loss": "loss/train", "validation_loss": "loss/validation",
           "learning_rate": "optimizer/learning_rate", "grad_norm": "optimizer/grad_norm",
           "samples_per_second": "throughput/samples_per_second",
           "tokens_per_second": "throughput/tokens_per_second",
           "tflops": "throughput/rank0_tflops", "step_seconds": "time/step_seconds"}


class TensorBoardLog:
    def __init__(self, folder: Path, plan: Plan) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.folder = folder
        self._writer = SummaryWriter(log_dir=str(folder), flush_secs=10)
        self._predicted = plan.predicted_samples_per_second
        # Markdown: a code block keeps the plan's JSON readable in the Text tab.
        self._writer.add_text("plan", "```\n" + plan.model_dump_json(indent=1) + "\n```", 0)

    def write(self, record: dict[str, Any]) -> None:
        """One progress record (cephalo.trainer.step_log.progress_record)."""
        step, wall = record["step"], record["time"]
        for key, tag in SCALARS.items():
            if record.get(key) is not None:
                self._writer.add_scalar(tag, record[key], step, walltime=wall)
        if self._predicted:
            self._writer.add_scalar("throughput/predicted_samples_per_second",
                                    self._predicted, step, walltime=wall)
        for timing in record.get("ranks", []):
            rank = timing["rank"]
            self._writer.add_scalar(f"ranks/compute_seconds/rank{rank}",
                                    timing["compute_seconds"], step, walltime=wall)
            self._writer.add_scalar(f"ranks/collective_wait_seconds/rank{rank}",
                                    timing["collective_wait_seconds"], step, walltime=wall)

    def close(self) -> None:
        self._writer.close()  # flushes


def open_log(tracking: TrackingSpec | None, progress_file: Path | None, plan: Plan,
             rank: int) -> TensorBoardLog | None:
    """Rank 0's log when the job asks for one and it can be written, else None (said once)."""
    if rank != 0 or tracking is None or not tracking.tensorboard:
        return None
    if progress_file is None:
        _warn("spec.tracking.tensorboard: no local folder to write event files into "
              "(checkpoints on object storage or none); training without them")
        return None
    try:
        return TensorBoardLog(progress_file.parent / FOLDER, plan)
    except ImportError as err:
        _warn(f"spec.tracking.tensorboard: {err} (pip install 'cephalo[tracking]'); "
              "training without event files")
        return None


def _warn(message: str) -> None:
    print(f"cephalo trainer (rank 0): warning: {message}", file=sys.stderr, flush=True)
