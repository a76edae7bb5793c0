"""Leaves zombies and orphans behind, then exits 3 when its stdin closes.

usage: orphans.py DIR. Makes 2 zombies (children that exit and are never waited for) and 2 orphans
(grandchildren whose parent exits). Each orphan writes orphan-<pid> holding the ppid it was
re-parented to, then sleeps until killed. Prints READY <json> once all orphans are re-parented.
"""

import json
import os
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
zombies = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    zombies.append(pid)

middles = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        middle = os.getpid()
        if os.fork() == 0:
            while os.getppid() == middle:
                time.sleep(0.01)
            tmp = out / f".tmp-{os.getpid()}"  # written then renamed: never seen half-written
            tmp.write_text(str(os.getppid()))
            tmp.rename(out / f"orphan-{os.getpid()}")
            while True:
                time.sleep(1)
        os._exit(0)  # the middle process: exits at once, never waited for (another zombie)
    middles.append(pid)

deadline = time.monotonic() + 30
while len(list(out.glob("orphan-*"))) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
orphans = {p.name.split("-")[1]: int(p.read_text()) for p in out.glob("orphan-*")}
print("READY", json.dumps({"zombies": zombies + middles, "orphans": orphans}), flush=True)
sys.stdin.read()
sys.exit(3)
