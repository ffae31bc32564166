"""Run as a module by tests/trainer/test_shaped_network.py (`start_timed_module`): prints
where the process runs, as JSON, and exits with the code its first argument gives."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

if __name__ == "__main__":
    autogroup = Path(f"/proc/{os.getpid()}/autogroup")
    print(json.dumps({
        "pid": os.getpid(), "sid": os.getsid(0),
        "niceness": os.getpriority(os.PRIO_PROCESS, 0),
        "autogroup": autogroup.read_text().split()[-1] if autogroup.exists() else None,
        "interfaces": sorted(name for _, name in socket.if_nameindex()),
        "cwd": os.getcwd(), "argv": sys.argv[1:], "marker": os.environ.get("MARKER"),
        "inherited": "CEPHALO_PLACEMENT_UNSET" in os.environ,
        # torch's threads where the fork server imported it (OMP_NUM_THREADS honoured)
        "threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None}))
    print("exiting", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
