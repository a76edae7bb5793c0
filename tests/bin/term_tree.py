"""A parent and two children in one process group; each writes term-<pid> on SIGTERM.

usage: term_tree.py DIR. Prints READY once every process has its handler; the parent exits 5 on
SIGTERM (after its children are gone), the children exit 0.
"""

import os
import signal
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])


def on_term(code: int) -> None:
    (out / f"term-{os.getpid()}").write_text("")
    os._exit(code)


children = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, lambda *_: on_term(0))
        (out / f"ready-{os.getpid()}").write_text("")
        while True:
            time.sleep(1)
    children.append(pid)


def parent_term(*_: object) -> None:
    for child in children:
        os.waitpid(child, 0)
    on_term(5)


signal.signal(signal.SIGTERM, parent_term)
while len(list(out.glob("ready-*"))) < len(children):
    time.sleep(0.01)
print("READY", os.getpid(), *children, flush=True)
while True:
    time.sleep(1)
