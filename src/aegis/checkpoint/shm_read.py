"""Reading a slot's bytes out of shared memory into tensors (the Saver's and the DCP reader's
loads alike). torch is imported inside the function."""

from __future__ import annotations

import os
from typing import Any

READ_CHUNK = 32 * 1024 * 1024


def read_into(fd: int, jobs: list[tuple[int, Any]], threads: int = 0) -> None:
    """Copy the bytes of the file ``fd`` at each ``(offset, tensor)`` into the CPU tensor
    (contiguous): one copy, by the kernel, from the page cache (shared memory) into the
    tensor's memory, in chunks over ``threads`` threads (default: torch's intra-op threads, as a
    ``copy_`` would use). A mapping of the shm file would cost a page-table entry per 4 KiB page
    (tmpfs has no huge pages) on top of the copy: that, not the copy, made the mapped restore
    slower than ``torch.load`` from a warm page cache."""
    import concurrent.futures

    import torch

    chunks = []
    for offset, target in jobs:
        nbytes = target.numel() * target.element_size()
        if nbytes:
            view = target.detach().reshape(-1).view(torch.uint8).numpy().data
            chunks += [(view, offset, start, min(start + READ_CHUNK, nbytes))
                       for start in range(0, nbytes, READ_CHUNK)]  # fmt: skip
    workers = min(threads or torch.get_num_threads(), len(chunks))
    if workers <= 1:
        for chunk in chunks:
            _pread_chunk(fd, *chunk)
        return
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="shm-read") as pool:
        list(pool.map(lambda chunk: _pread_chunk(fd, *chunk), chunks))


def _pread_chunk(fd: int, view: memoryview, offset: int, start: int, end: int) -> None:
    done = start
    while done < end:
        got = os.preadv(fd, [view[done:end]], offset + done)
        if got <= 0:
            raise OSError(f"short read from shared memory at {offset + done}")
        done += got
