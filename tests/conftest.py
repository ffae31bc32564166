"""Suite-wide settings: Hypothesis draws the same examples on every run, and under
pytest-xdist (`pytest -n 2`, the README's test command) a file's tests share a worker.

A test's verdict must not depend on luck: with `derandomize` every property test draws its
examples from a seed fixed by the test's own name, and no example database is read or
written, so a clean checkout and CI see exactly what a developer saw. To hunt for new
failures, run with CEPHALO_HYPOTHESIS_PROFILE=explore (random seeds, a local database in
.hypothesis/); keep whatever it finds as an `@example` or a named regression test.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

try:
    from hypothesis import settings
except ImportError:  # an image with torch and pytest only (scripts/device-check.sh)
    settings = None

if settings is not None:
    settings.register_profile("deterministic", derandomize=True, database=None,
                              print_blob=True)
    settings.register_profile("explore", derandomize=False, print_blob=True)
    settings.load_profile(os.environ.get("CEPHALO_HYPOTHESIS_PROFILE", "deterministic"))


# pytest-xdist (the README's `pytest -n 2`): a file's tests run on one worker, as written (its
# module fixtures, e.g. a moto server or a trained model, are made once), and the whole
# tests/realk8s folder on one worker, so that one real control plane serves it (its session
# fixtures start etcd, kube-apiserver and the rest: once, not per worker). That folder is the
# longest unit and mostly waits on the API server, so it starts first, beside CPU-bound work.
REALK8S_SCOPE = "tests/realk8s"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return REALK8S_SCOPE if path.startswith(REALK8S_SCOPE + "/") else path

        def _assign_work_unit(self, node: Any) -> None:
            if REALK8S_SCOPE in self.workqueue:
                self.workqueue.move_to_end(REALK8S_SCOPE, last=False)
            for scope in EXCLUSIVE_SCOPES:
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope)
            super()._assign_work_unit(node)

    return FileScheduling(config, log)


# Tests marked `exclusive` run while no other test of the session runs: their verdict is a
# timing on this machine's cores (a plan's predicted step against the measured one on a shaped
# link), which the other xdist worker's load moved outside its band (CI: 0.72 at 300 Mbit/s
# with the other worker busy; 1.00 alone; and, with the compute its run measured in the
# verdict, the probe's reading of the 50 Mbit/s link 0.73 of the rate, 0.81 alone). A
# turnstile of two flock(2) files shared by the workers: every test holds `run` shared; an
# exclusive one takes `gate` (so no new test starts) and then `run` exclusively (so it waits
# for the running ones to end). The scheduler hands the exclusive files out last, where the
# other worker has the least left.
EXCLUSIVE_MARK = "exclusive"
# The files that hold exclusive tests (the scheduler, in xdist's controller, sees node ids
# only, not markers): a marked test elsewhere is a usage error at collection.
# (tests/trainer/test_hybrid_shaped.py is not one: its link's collectives outlast its compute
# five times over, so a loaded machine moves its ratio within the band; its docstring says why.)
EXCLUSIVE_SCOPES = ("tests/trainer/test_shaped_plan.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if (item.get_closest_marker(EXCLUSIVE_MARK) is not None
                and item.nodeid.split("::", 1)[0] not in EXCLUSIVE_SCOPES):
            raise pytest.UsageError(f"{item.nodeid} is marked {EXCLUSIVE_MARK}: add its file "
                                    "to EXCLUSIVE_SCOPES in tests/conftest.py")


LOCK_DIR = pytest.StashKey[Path]()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist's controller: one folder for the turnstile's files, handed to every worker and
    removed when the session ends (pytest_unconfigure)."""
    stash = node.config.stash
    if LOCK_DIR not in stash:
        stash[LOCK_DIR] = Path(tempfile.mkdtemp(prefix="cephalo-pytest-"))
    node.workerinput["cephalo_lock_dir"] = str(stash[LOCK_DIR])


def pytest_unconfigure(config: pytest.Config) -> None:
    if LOCK_DIR in config.stash:
        shutil.rmtree(config.stash[LOCK_DIR], ignore_errors=True)


def _lock_dir(config: pytest.Config) -> Path | None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:  # not under xdist: nothing runs beside this test
        return None
    return Path(workerinput["cephalo_lock_dir"])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    folder = _lock_dir(item.config)
    if folder is None:
        yield
        return
    exclusive = item.get_closest_marker(EXCLUSIVE_MARK) is not None
    with open(folder / "gate", "a") as gate, open(folder / "run", "a") as run:
        if exclusive:
            fcntl.flock(gate, fcntl.LOCK_EX)
            fcntl.flock(run, fcntl.LOCK_EX)
        else:
            fcntl.flock(gate, fcntl.LOCK_SH)
            fcntl.flock(run, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(run, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)
