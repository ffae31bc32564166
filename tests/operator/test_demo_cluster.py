"""scripts/demo-cluster.sh, the docs' recorded terminal session (issue 27; on the first-job
page, docs/getting-started/first-job.md, since issue 37): in tmux against
the emulated cluster, `cephalo plan --cluster`, `cephalo submit --watch` to Succeeded with a
live progress bar, `cephalo status` and `cephalo logs`. Run as written, so that the recording
the docs show (docs/demo-cluster/) can always be made again."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None,
                    reason="the demo records in tmux: apt-get install tmux")
def test_the_recorded_demo_runs_to_succeeded(tmp_path: Path) -> None:
    done = subprocess.run([str(REPO / "scripts" / "demo-cluster.sh"), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    session = (tmp_path / "session.txt").read_text().splitlines()
    assert session[0] == "$ cephalo plan --cluster --job examples/custom-tiny-gpt.yaml | head -12"
    assert any(line.startswith("Succeeded: 1 rank completed; step 50, loss ")
               for line in session), session
    assert "exit code 0" in session
    table = session[session.index("$ cephalo status") + 1:][:2]
    assert table[1].split()[:4] == ["custom-tiny-gpt", "Succeeded", "1xNVIDIA-L4", "50/50"]
    assert session[-2] == "[rank 0] training done; final checkpoint written", session[-4:]
    live = (tmp_path / "watch-live.txt").read_text().splitlines()
    bar = [line for line in live if line.startswith("Running  [")]
    assert bar and "█" in bar[-1] and "ETA" in bar[-1], live[-3:]
