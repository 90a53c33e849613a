"""Read a memory-mapped tensor's pages in the background, ahead of their first use.

Why: the embedding table stays where the loader found it, often a private mapping of
the converted model's safetensors file (the linear layers are copied into huge pages, the
embedding table is not: a step reads one row of it a token). When the file is not in
the page cache (after a reboot, or once other files pushed it out), the first read of
each row is a disk read: 8-11 ms a new token on a 2-core cloud machine with
Llama-3.2-1B's table in float32 (1 GB), a tenth of a decode step. `MADV_WILLNEED` took
the advice and read nothing there, so a daemon thread reads one byte a page, in order:
the kernel reads the file ahead sequentially, loading does not wait, and the pages stay
the kernel's to reclaim, unlike a copy's. The thread reads through numpy, not torch: a
second thread running torch ops starts an OpenMP pool of its own beside the engine's
(docs/architecture.md, "Threads").
"""

from __future__ import annotations

import threading

import torch

PAGE = 4096


def read_ahead(tensor: torch.Tensor) -> threading.Thread | None:
    """Start reading `tensor`'s storage one byte a page on a daemon thread (the thread, or
    None for a tensor off the CPU or empty)."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    storage = tensor.untyped_storage()
    pages = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()[::PAGE]

    def touch() -> None:
        pages.sum()  # numpy reads the strided bytes without the GIL

    thread = threading.Thread(target=touch, name="kvchat-read-ahead", daemon=True)
    thread.start()
    return thread
