"""Prints its restart count, MASTER_PORT and pids (its own and a child's), then waits forever."""

import os
import subprocess
import sys
import time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(
    "INCARNATION",
    os.environ.get("AEGIS_RESTART_COUNT"),
    os.environ.get("MASTER_PORT", "-"),
    os.getpid(),
    child.pid,
    flush=True,
)
while True:
    time.sleep(1)
