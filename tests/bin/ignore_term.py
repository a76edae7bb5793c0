"""Ignores SIGTERM and waits forever: only SIGKILL ends it."""

import os
import signal
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("READY", os.getpid(), flush=True)
while True:
    time.sleep(1)
