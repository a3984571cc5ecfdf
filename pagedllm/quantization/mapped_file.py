"""A checkpoint file mapped read-only into memory, and its pages given back once copied elsewhere.

A GGUF tensor's blocks are used as they lie in the file: the loader hands out views of one mapping
instead of reading each tensor into fresh memory (one copy of the model fewer). The pages a view
touches count in the process's resident set until the mapping goes, and loading copies every
weight once more (int8 tiles, the huge-page arena), so each copy's source pages are given back as
soon as it is made (``release_pages``): the resident set then holds the model about once, not twice.
Giving back a page of a read-only file mapping loses nothing: the next read maps it again from the
file (or the page cache), with the same bytes. The mapping is read-only, so a write through a view
faults instead of changing a page that would later be given back.
"""

from __future__ import annotations

import mmap
import warnings
import weakref

import numpy as np
import torch

# Live mappings: (first address, end address, the mapping's array), weakly held so a mapping
# goes with the last view of it.
_mappings: list[tuple[int, int, weakref.ref[np.ndarray]]] = []


def map_file(path: str) -> np.ndarray:
    """The file as a read-only uint8 array over one shared mapping."""
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    data = np.frombuffer(mapping, dtype=np.uint8)  # holds the mapping: it closes with the last view
    start = data.__array_interface__["data"][0]
    _mappings[:] = [m for m in _mappings if m[2]() is not None]
    _mappings.append((start, start + data.nbytes, weakref.ref(data)))
    return data


def as_tensor(view: np.ndarray) -> torch.Tensor:
    """A torch tensor over ``view`` (no copy). torch warns that the memory is read-only; the
    weights are never written in place, and a write would fault rather than go unnoticed."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(view)


def in_mapped_file(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes lie in a live mapping of ``map_file`` (used in place, not copied)."""
    return _mapping_of(tensor) is not None


def release_pages(tensor: torch.Tensor) -> int:
    """Give back the whole pages of a mapped file that ``tensor``'s bytes span; returns the bytes
    given back (0 when the tensor is not in a mapping of ``map_file``)."""
    found = _mapping_of(tensor)
    if found is None:
        return 0
    start, data = found
    first = tensor.data_ptr() - start
    page = mmap.PAGESIZE
    lo = -(-first // page) * page  # whole pages only: a neighbour may share the edge pages
    hi = (first + tensor.numel() * tensor.element_size()) // page * page
    if hi <= lo:
        return 0
    data.base.obj.madvise(mmap.MADV_DONTNEED, lo, hi - lo)  # the mmap under the array's buffer
    return hi - lo


def _mapping_of(tensor: torch.Tensor) -> tuple[int, np.ndarray] | None:
    """(first address, array) of the live mapping holding all of ``tensor``'s bytes, if any."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    first = tensor.data_ptr()
    end = first + tensor.numel() * tensor.element_size()
    for start, stop, ref in _mappings:
        if start <= first and end <= stop:
            data = ref()
            return None if data is None else (start, data)
    return None
