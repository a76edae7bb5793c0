"""A forkserver with nothing to preload (tests/test_forkserver.py), on :mod:`aegis.forking`.

Options (in pairs, besides ``--fd``/``--agent``): ``--nanny 1`` serves one child as its nanny;
``--fail REASON`` fails at once; ``--thread 1`` starts a thread as it "imports" (so it may not
fork). A child prints ``CHILD {"pid", "ppid", "pgid", "comm", "sigint", "blocked"}``, then
pauses (``{"pause": true}``) or exits with ``{"exit": N}``.
"""

import json
import os
import signal
import sys
import threading
from typing import Any

from aegis import forking


def prewarm(options: dict[str, str]) -> dict[str, Any]:
    if options.get("--fail"):
        return {"failed": options["--fail"]}
    if options.get("--thread") == "1":
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    return {"preloaded": "nothing"}


def child(request: dict[str, Any]) -> int:
    with open("/proc/self/comm") as comm:
        name = comm.read().strip()
    seen = {"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "comm": name,
            "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))}  # fmt: skip
    print("CHILD", json.dumps(seen), flush=True)
    if request.get("pause"):
        signal.pause()
    return int(request.get("exit", 0))


if __name__ == "__main__":
    argv = sys.argv[1:]
    nanny = dict(zip(argv[::2], argv[1::2], strict=False)).get("--nanny") == "1"
    _, request = forking.run_server(argv, prewarm, name=b"tiny-server", child_name=b"tiny-child",
                                    nanny=nanny)  # fmt: skip
    os._exit(child(request))
