"""Suite-wide settings: Hypothesis draws the same examples on every run.

A test's verdict must not depend on luck: with `derandomize` every property test draws its
examples from a seed fixed by the test's own name, and no example database is read or
written, so a clean checkout and CI see exactly what a developer saw. To hunt for new
failures, run with CEPHALO_HYPOTHESIS_PROFILE=explore (random seeds, a local database in
.hypothesis/); keep whatever it finds as an `@example` or a named regression test.
"""

from __future__ import annotations

import os

try:
    from hypothesis import settings
except ImportError:  # an image with torch and pytest only (scripts/device-check.sh)
    settings = None

if settings is not None:
    settings.register_profile("deterministic", derandomize=True, database=None,
                              print_blob=True)
    settings.register_profile("explore", derandomize=False, print_blob=True)
    settings.load_profile(os.environ.get("CEPHALO_HYPOTHESIS_PROFILE", "deterministic"))
