"""Prints its restart count, MASTER_PORT, pids (its own and a child's) and the job's variable
JOB_VAR, then waits forever."""

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
    os.environ.get("JOB_VAR", "-"),
    flush=True,
)
while True:
    time.sleep(1)
