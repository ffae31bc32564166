"""The figures of `scripts/device-check.sh`, as JSON, as they come (issue 43, item 7).

Only 8 files come back from the device machine, so every step's figures go into ONE file,
`summary.jsonl` under $OUT: one JSON object per step, appended when the step ends (a run
cut short still returns every step before it).

    python scripts/device_check_summary.py step SUMMARY KEY NAME EXIT SECONDS TIMEOUT [FIGURES]
        append the step's line; FIGURES: the JSON file the step wrote (absent, empty or
        not JSON: said so in the line, not an error: the step's exit status tells why)
    python scripts/device_check_summary.py run-memory RUN_DIR OUTPUT
        the peak GPU memory of every rank of a `cephalo run` against the plan, read from
        the trainer's lines in RUN_DIR/logs/rank-*.log (trainer/run.py `memory_report`),
        written to OUTPUT as JSON

Standard library only: it runs before anything else is known to import.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

# trainer/run.py memory_report: "(rank R): peak GPU memory ... (peak_memory_bytes=P
# memory_estimate_bytes=E predicted_memory_bytes=Q)"; Q may be None.
MEMORY_LINE = re.compile(
    r"\(rank (\d+)\): peak GPU memory .*\(peak_memory_bytes=(\d+) "
    r"memory_estimate_bytes=(\d+|None) predicted_memory_bytes=(\d+|None)\)")


def step_record(key: str, name: str, exit_code: int, seconds: float, timeout_seconds: int,
                figures_file: Path | None) -> dict[str, Any]:
    record: dict[str, Any] = {"step": key, "name": name, "exit": exit_code,
                              "timed_out": exit_code in (124, 137), "seconds": seconds,
                              "timeout_seconds": timeout_seconds, "figures": None}
    if figures_file is not None:
        try:
            record["figures"] = json.loads(figures_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            record["figures_missing"] = f"{figures_file.name}: {type(err).__name__}: {err}"
    return record


def _int(text: str) -> int | None:
    return None if text == "None" else int(text)


def run_memory(run_dir: Path) -> dict[str, Any]:
    """Every GPU rank's peak allocated bytes against the engine's estimate and the plan's
    prediction (ratio: peak / estimate; above 1 is the working set the model leaves out,
    far above it a defect)."""
    ranks = []
    for log in sorted((run_dir / "logs").glob("rank-*.log")):
        for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
            found = MEMORY_LINE.search(line)
            if found is None:
                continue
            rank, peak, estimate, predicted = found.groups()
            est = _int(estimate)
            ranks.append({"rank": int(rank), "peak_memory_bytes": int(peak),
                          "memory_estimate_bytes": est,
                          "predicted_memory_bytes": _int(predicted),
                          "peak_over_estimate": int(peak) / est if est else None})
    return {"run_dir": str(run_dir), "ranks": sorted(ranks, key=lambda r: r["rank"])}


def main(argv: list[str]) -> int:
    usage = __doc__.split("\n\n")[2]
    if argv[:1] == ["step"] and len(argv) in (7, 8):
        summary, key, name, code, seconds, timeout = argv[1:7]
        record = step_record(key, name, int(code), float(seconds), int(timeout),
                             Path(argv[7]) if len(argv) == 8 else None)
        with open(summary, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        return 0
    if argv[:1] == ["run-memory"] and len(argv) == 3:
        Path(argv[2]).write_text(json.dumps(run_memory(Path(argv[1])), indent=1) + "\n",
                                 encoding="utf-8")
        return 0
    print(f"device_check_summary.py: error: bad arguments {argv}; usage:\n{usage}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
