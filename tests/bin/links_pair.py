"""Two ranks of a real gloo group measure their one link (``aegis.checks.links.Links``) after
each was given a different view of its rate: ``links_pair.py RANK PORT RATE`` (RATE in bytes/s,
"none": no rate seen yet). Prints the buffer size the rank measured with, as JSON."""

from __future__ import annotations

import json
import math
import sys
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from aegis.checks import links

rank, port, rate = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                        timeout=timedelta(seconds=60))  # fmt: skip
args = SimpleNamespace(world_size=2, rank=rank, max_pair_rounds=4, pair_repeats=1,
                       pair_iterations=2, pair_mb=1.0)  # fmt: skip
pair = links.Links(torch, dist, args, torch.device("cpu"), adapt=True)
if rate != "none":
    pair.rates[0] = float(rate)
own = links.pair_floats(args, pair.rates.get(0, math.inf))  # what this rank would size
pair.repeat()
print(json.dumps({"rank": rank, "own": own, "floats": pair.sizes[0]}))
dist.destroy_process_group()
