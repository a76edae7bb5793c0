"""Makes progress, then hangs in stuck_in_allreduce().

usage: hang.py progress|output. 'progress' calls aegis.progress() for a few steps; 'output' only
prints lines (a script that never reports progress). The HANGING line carries the script's
``time.monotonic()`` as it stops: the spell of its hang starts after it.
"""

import sys
import time

import aegis


def stuck_in_allreduce() -> None:
    while True:
        time.sleep(0.05)


mode = sys.argv[1]
for step in range(5):
    if mode == "progress":
        aegis.progress(step)
    else:
        print("step", step, flush=True)
    time.sleep(0.02)
print("HANGING", time.monotonic(), flush=True)  # when its last spell of activity ends
if mode == "progress":
    aegis.progress(5)
stuck_in_allreduce()
