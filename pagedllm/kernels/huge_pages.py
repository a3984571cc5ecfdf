"""Large CPU buffers in transparent huge pages: 2 MB pages, each physically contiguous.

A CPU step streams its weights from memory, and how fast it streams depends on the pages under
them: 4 KB pages handed out while a process churns through temporaries end up scattered, cost a
TLB miss each (two-level walks in a VM) and break the hardware prefetchers' runs at every page. A
mapping of its own, advised for huge pages, gets 2 MB pages where the kernel allows them
(``/sys/kernel/mm/transparent_hugepage/enabled`` set to ``madvise`` or ``always``) and fresh pages
otherwise. ``PAGEDLLM_HUGE_PAGES=0`` turns it off (callers then keep torch's allocations). The CPU
KV pool lies in them too (worker/cache_engine.py): its blocks are read in runs of a few KB from
anywhere in the pool, a TLB miss per run in 4 KB pages.

Measured on a 2-core VM: reading 64 MB took 10 ms in 4 KB pages and 4.4 ms in huge pages; after
2 s untouched, 309 ms and 32 ms (memory a VM leaves idle comes back slowly, and per page).
"""

from __future__ import annotations

import mmap

import torch

from pagedllm.kernels.config import kernel_config

HUGE_PAGE = 2 << 20


def huge_pages_enabled() -> bool:
    return kernel_config().huge_pages


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 CPU tensor of ``nbytes`` starting on a 2 MB boundary, advised for huge
    pages. Its memory goes back to the system when the last tensor viewing it is freed."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    start = -whole.data_ptr() % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE") and nbytes:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    return whole[start:start + nbytes]
