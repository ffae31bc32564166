"""The suite's turnstile for timing verdicts (tests/conftest.py, marker `exclusive`): under
`pytest -n 2`, no other test runs while an exclusive one does. Checked on a small generated
suite run by real pytest-xdist: every test writes the interval it ran in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The repository is appended to sys.path, not put on PYTHONPATH: its `operator/` folder would
# shadow the standard library's `operator` at interpreter start.
CONFTEST = """\
import sys
sys.path.append({repo!r})
from tests.conftest import (pytest_collection_modifyitems, pytest_configure_node,
                            pytest_runtest_protocol, pytest_unconfigure,
                            pytest_xdist_make_scheduler)
"""
INI = """\
[pytest]
markers =
    exclusive: runs alone
"""
TEST = """\
import os, time, pytest
from pathlib import Path
{mark}
@pytest.mark.parametrize("i", range({count}))
def test_{name}(i):
    start = time.monotonic()
    time.sleep({seconds})
    Path(os.environ["INTERVALS"], f"{name}{{i}}").write_text(f"{{start}} {{time.monotonic()}}")
"""


def _suite(root: Path, exclusive_file: str) -> None:
    (root / "conftest.py").write_text(CONFTEST.format(repo=str(REPO)))
    (root / "pytest.ini").write_text(INI)
    # The long file goes first (xdist hands out the files with most tests first) and is still
    # running when the other worker, through its short files, reaches the exclusive one (handed
    # out last): without the turnstile the two overlap (seen with the hook disabled).
    files = {exclusive_file: ("alone", "@pytest.mark.exclusive", 1, 1.0),
             "tests/unit/test_long.py": ("long", "", 5, 1.0)}
    files.update({f"tests/unit/test_busy_{i}.py": (f"busy_{i}", "", 1, 0.2) for i in range(6)})
    for path, (name, mark, count, seconds) in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(TEST.format(name=name, mark=mark, count=count,
                                             seconds=seconds))


def _pytest(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, INTERVALS=str(root / "intervals"), TMPDIR=str(root / "tmp"))
    (root / "intervals").mkdir(exist_ok=True)
    (root / "tmp").mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


def test_no_test_runs_beside_an_exclusive_one(tmp_path: Path) -> None:
    _suite(tmp_path, "tests/trainer/test_shaped_plan.py")
    done = _pytest(tmp_path, "-n", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    intervals = {p.name: tuple(map(float, p.read_text().split()))
                 for p in (tmp_path / "intervals").iterdir()}
    assert len(intervals) == 12, intervals
    start, end = intervals.pop("alone0")
    beside = [name for name, (s, e) in intervals.items() if s < end and e > start]
    assert beside == [], (beside, start, end, intervals)
    # The turnstile's folder went with the session (pytest's own basetemp stays, as always).
    assert [p.name for p in (tmp_path / "tmp").iterdir()
            if p.name.startswith("cephalo-")] == []


def test_an_exclusive_test_outside_the_listed_files_is_a_usage_error(tmp_path: Path) -> None:
    _suite(tmp_path, "tests/unit/test_elsewhere.py")
    done = _pytest(tmp_path, "-p", "no:xdist")
    assert done.returncode == 4, done.stdout + done.stderr
    assert "add its file to EXCLUSIVE_SCOPES" in done.stdout + done.stderr
