"""Prints what a started script sees (one PROBE <json> line), then ends as told.

usage: probe_main.py [exit CODE | raise | kill SIG | pause | progress STEP]: ``exit 3`` exits 3,
``raise`` raises (status 1), ``kill 15`` kills itself with signal 15, ``pause`` waits for a
signal, ``progress 5`` reports step 5 to the agent, prints a CUDA error to stderr, then pauses.
"""

import json
import os
import signal
import sys
import threading
from pathlib import Path

print(
    "PROBE",
    json.dumps(
        {
            "argv": sys.argv,
            "name": __name__,
            "file": __file__,
            "main_is_us": sys.modules["__main__"].__dict__ is globals(),
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "ppid": os.getppid(),
            "comm": Path("/proc/self/comm").read_text().strip(),
            "path0": sys.path[0],
            "pgid_is_pid": os.getpgid(0) == os.getpid(),
            "threads": threading.active_count(),
            "sigint": repr(signal.getsignal(signal.SIGINT)),
            "sigterm": repr(signal.getsignal(signal.SIGTERM)),
            "sigpipe": repr(signal.getsignal(signal.SIGPIPE)),
            "orig_argv_tail": sys.orig_argv[-len(sys.argv) + 1 :] if len(sys.argv) > 1 else [],
        },
        sort_keys=True,
    ),
    flush=True,
)
action = sys.argv[1] if len(sys.argv) > 1 else "exit"
if action == "exit":
    sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
if action == "raise":
    raise RuntimeError("probe raised")
if action == "kill":
    os.kill(os.getpid(), int(sys.argv[2]))
if action == "progress":
    import aegis

    aegis.progress(int(sys.argv[2]))
    print("CUDA error: an illegal memory access was encountered (probe)", file=sys.stderr)
    sys.stderr.flush()
if action in ("pause", "progress"):
    while True:
        signal.pause()
