"""`cephalo.cli.main` called in-process gives the caller its own SIGTERM handler back."""

from __future__ import annotations

import signal

import pytest

from cephalo.cli import main


def test_main_restores_the_callers_sigterm_handler(capsys: pytest.CaptureFixture[str]) -> None:
    """It left its own behind: a pytest that had run a command in-process raised Terminated
    inside whatever test ran next on SIGTERM, and went on running (its real control plane
    too) instead of stopping."""
    def mine(_signum: int, _frame: object) -> None:
        raise AssertionError("not called")

    before = signal.signal(signal.SIGTERM, mine)
    try:
        assert main(["crd"]) == 0
        assert signal.getsignal(signal.SIGTERM) is mine
        assert main(["plan", "--model", "no-such-model", "--batch-size", "8",
                     "--gpus", "1xL4"]) == 2  # an error, exit 2
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)
    assert "no-such-model" in capsys.readouterr().err
