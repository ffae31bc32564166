"""Suite-wide settings: Hypothesis draws the same examples on every run, and under
pytest-xdist (`pytest -n 2`, the README's test command) a file's tests share a worker.

A test's verdict must not depend on luck: with `derandomize` every property test draws its
examples from a seed fixed by the test's own name, and no example database is read or
written, so a clean checkout and CI see exactly what a developer saw. To hunt for new
failures, run with CEPHALO_HYPOTHESIS_PROFILE=explore (random seeds, a local database in
.hypothesis/); keep whatever it finds as an `@example` or a named regression test.
"""

from __future__ import annotations

import os
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
            super()._assign_work_unit(node)

    return FileScheduling(config, log)
