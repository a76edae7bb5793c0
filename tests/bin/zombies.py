"""Leaves 2 zombies and 1 orphan (asleep in its group) behind, prints READY <json>, exits 3.

The orphan waits until it has been re-parented (to the nearest subreaper), so the READY line
names its new parent.
"""

import json
import os
import sys
import time

zombies = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    zombies.append(pid)
read_fd, write_fd = os.pipe()
middle = os.fork()
if middle == 0:
    me = os.getpid()
    if os.fork() == 0:
        while os.getppid() == me:
            time.sleep(0.005)
        os.write(write_fd, f"{os.getpid()} {os.getppid()}\n".encode())
        while True:
            time.sleep(1)
    os._exit(0)
os.waitpid(middle, 0)
orphan, parent = os.read(read_fd, 100).decode().split()
print("READY", json.dumps({"zombies": zombies, "orphan": int(orphan), "parent": int(parent)}))
sys.stdout.flush()
sys.exit(3)
