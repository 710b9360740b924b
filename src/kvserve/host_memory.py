"""Host memory of the big, long-lived CPU tensors: one arena for the KV pool (lazily zeroed), one of
2 MiB pages for the packed weights.

A decode step reads every weight once and walks the KV blocks in whatever order the block tables
give: with 4 KiB pages that is a TLB entry per 4 KiB. Linux backs a region with transparent huge
pages when asked (``madvise(MADV_HUGEPAGE)``; ``madvise`` is the usual system default, so untouched
memory stays on 4 KiB pages unless a program asks). Measured on SmolLM2's shapes, 2 threads, 30
layers with cold caches: decode attention over 16 sequences of 190 tokens -12%, the 4-bit
projections of one token -10%; in the engine (one process, two copies of the model alternating) a
16-stream decode step 40.8 -> 36.9 ms, one stream unchanged. The KV pool was meant to be huge pages too,
but its mapping was shared (shmem, which gets none by default) and so never was: see ``zeroed_bytes``.

On another OS, another device, below 2 MiB, or where the kernel refuses: ordinary memory, the same
bytes. Tensors laid out by ``arena`` are views of one buffer, so they stay exactly as they were
(contiguous, same shape and dtype). Host memory is numpy (the CPU runtime needs no torch); the
``*_bytes`` functions and ``arena`` hand it out as tensors for the torch path (and device memory
elsewhere).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # imported where a tensor is made: release_freed_memory needs no torch
    import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_ALIGN = 64  # every tensor starts on a cache line


@cache
def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.madvise
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return function


def empty_array(nbytes: int) -> np.ndarray:
    """uint8 [nbytes] host memory; on Linux and from 2 MiB, starting on a 2 MiB boundary and advised as
    huge pages (before it is touched, so the first write faults in whole 2 MiB pages)."""
    madvise = _madvise() if sys.platform.startswith("linux") else None
    if madvise is None or nbytes < HUGE_PAGE:
        return _line_aligned(np.empty(nbytes + _ALIGN, dtype=np.uint8), nbytes)
    return _huge_aligned(np.empty(nbytes + HUGE_PAGE, dtype=np.uint8), nbytes, madvise)


def empty_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    """``empty_array`` as a tensor on the CPU; plain device memory elsewhere."""
    import torch

    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return torch.from_numpy(empty_array(nbytes))


def _line_aligned(raw: np.ndarray, nbytes: int) -> np.ndarray:
    """The ``nbytes`` of ``raw`` (_ALIGN more than that) from its first cache line (numpy aligns to 16
    bytes; the kernels' vectors and the arenas' offsets assume 64, as torch's allocator gave)."""
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes]


def _huge_aligned(raw: np.ndarray, nbytes: int, madvise) -> np.ndarray:
    """The ``nbytes`` of ``raw`` (HUGE_PAGE more than that) from its first 2 MiB boundary, advised as huge
    pages where ``madvise`` is given: a view, which keeps ``raw`` alive."""
    start = -raw.ctypes.data % HUGE_PAGE
    buffer = raw[start : start + nbytes]
    advised = nbytes // HUGE_PAGE * HUGE_PAGE
    if madvise is not None and madvise(buffer.ctypes.data, advised, _MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused (errno %d): 4 KiB pages", ctypes.get_errno())
    return buffer


def _offsets(sizes: list[int]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for size in sizes:
        start = -(-end // _ALIGN) * _ALIGN
        offsets.append(start)
        end = start + size
    return offsets, end


def _views(specs: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device,
           zeroed: bool = False) -> list[torch.Tensor]:
    """Tensors of the given (shape, dtype), each a contiguous view of one ``empty_bytes`` buffer
    (uninitialized) or ``zeroed_bytes`` buffer."""
    import torch

    sizes = [torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size() for shape, dtype in specs]
    offsets, total = _offsets(sizes)
    buffer = (zeroed_bytes if zeroed else empty_bytes)(total, device)
    return [
        buffer[o : o + n].view(dtype).view(shape) for o, n, (shape, dtype) in zip(
            offsets, sizes, specs, strict=True)]


def zeroed_array(nbytes: int) -> np.ndarray:
    """uint8 [nbytes] host memory, zeroed. On Linux from 2 MiB a fresh private anonymous mapping, which the
    kernel zeroes page by page as each is first touched: no pass over the whole buffer at start-up (a KV
    pool of a 32K context: ~1 s of memset on 2 cores) and no resident page until a block is written.

    Not advised as huge pages, unlike ``empty_array``: a pool is touched block by block, and each layer's
    first block would fault in a whole 2 MiB page (SmolLM2 answering "Hi": +75 MiB resident), for a
    decode gain that did not reproduce (4K-token history, alternating pairs on a Zen 3 VM: +17% in one
    run, -14% in the next). Private, not Python's default MAP_SHARED: shared anonymous memory is shmem,
    counted and reclaimed apart from the process's own."""
    if not sys.platform.startswith("linux") or nbytes < HUGE_PAGE:
        return _line_aligned(np.zeros(nbytes + _ALIGN, dtype=np.uint8), nbytes)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled
    return _huge_aligned(np.frombuffer(region, dtype=np.uint8), nbytes, None)  # the view keeps it mapped


def zeroed_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    """``zeroed_array`` as a tensor on the CPU; zeroed device memory elsewhere."""
    import torch

    if device.type != "cpu":
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return torch.from_numpy(zeroed_array(nbytes))


def arena(specs: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> list[torch.Tensor]:
    """Zeroed tensors of the given (shape, dtype), each a contiguous view of one buffer (``zeroed_bytes``)."""
    return _views(specs, device, zeroed=True)


def array_arena(specs: list[tuple[tuple[int, ...], type]]) -> list[np.ndarray]:
    """Zeroed numpy arrays of the given (shape, dtype), each a contiguous, cache-line aligned view of one
    ``zeroed_array`` buffer: ``arena`` for the CPU runtime."""
    sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in specs]
    offsets, total = _offsets(sizes)
    buffer = zeroed_array(total)
    return [buffer[o : o + n].view(dtype).reshape(shape)
            for o, n, (shape, dtype) in zip(offsets, sizes, specs, strict=True)]


class PackingArena:
    """The packed weights of one model load, written straight into one 2 MiB-page region: a bump
    allocator over a reserved (``MAP_NORESERVE``), untouched mapping, so a packed tensor faults its pages
    in once, where it stays, instead of being packed into 4 KiB pages and copied into an arena after
    (``rehome``: a second first-touch pass, 0.7 s of Qwen2.5-0.5B's load on a 2-core VM). Pages never
    written stay virtual; only the region's last huge page can be part-used. Hands out nothing it cannot
    fit (the caller then allocates as before and ``rehome`` copies)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = -(-capacity // HUGE_PAGE) * HUGE_PAGE
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
        self._region = mmap.mmap(-1, self.capacity + HUGE_PAGE, flags=flags)
        raw = np.frombuffer(self._region, dtype=np.uint8)  # the views keep it mapped
        madvise = _madvise() if sys.platform.startswith("linux") else None
        self.buffer = _huge_aligned(raw, self.capacity, madvise)
        self.used = 0

    def take(self, nbytes: int) -> np.ndarray | None:
        """uint8 [nbytes] of the region, starting on a cache line; None where it does not fit."""
        start = -(-self.used // _ALIGN) * _ALIGN
        if start + nbytes > self.capacity:
            return None
        self.used = start + nbytes
        return self.buffer[start : start + nbytes]

    def holds(self, array: np.ndarray) -> bool:
        base = self.buffer.ctypes.data
        return base <= array.ctypes.data < base + self.capacity


_packing: ContextVar[PackingArena | None] = ContextVar("kvserve_packing_arena", default=None)


@contextmanager
def packing_arena(capacity: int):
    """While open, ``packed_bytes`` hands out the region of one ``PackingArena`` of ``capacity`` bytes
    (virtual: an over-estimate costs no memory)."""
    arena = PackingArena(capacity) if capacity > 0 else None
    token = _packing.set(arena)
    try:
        yield arena
    finally:
        _packing.reset(token)


def packed_bytes(nbytes: int) -> np.ndarray:
    """uint8 [nbytes] for a packed weight that lives as long as its model: from the open packing arena
    where it fits, else ``empty_array`` (which ``rehome`` moves into an arena later)."""
    arena = _packing.get()
    taken = arena.take(nbytes) if arena is not None else None
    return taken if taken is not None else empty_array(nbytes)


TRIM_EVERY = 16 << 20  # bytes moved or packed between two malloc_trim calls during a load


class HeapTrimmer:
    """Hands the C heap's freed pages back every TRIM_EVERY bytes a load moves or packs: its freed
    temporaries sit below glibc's mmap threshold (which rises with every big free), so they would stay
    resident until the load's end (Qwen2.5-0.5B: ~90 MiB)."""

    def __init__(self) -> None:
        self.since = 0

    def add(self, nbytes: int) -> None:
        self.since += nbytes
        if self.since >= TRIM_EVERY:
            release_freed_memory()
            self.since = 0


def rehome(owners: list, attribute: str) -> None:
    """Moves each owner's host array ``attribute`` (numpy) into one arena, written once. One at a time: an
    original is let go (freed when nothing else holds it) before the next is copied, so the move costs
    one array beyond the arena, not a second copy of them all (SmolLM2's packed weights: 96 MiB more
    at the load's peak when they were copied together); the C heap's freed pages go back to the OS every
    TRIM_EVERY bytes, else the originals stay resident in glibc's heap until the load's end."""
    arena = _packing.get()
    if arena is not None:  # packed into the load's arena already: in place, on 2 MiB pages
        owners = [o for o in owners if not arena.holds(getattr(o, attribute))]
    if not owners:
        return
    release_freed_memory()  # what the load freed so far, before the arena adds to it
    arrays = [getattr(o, attribute) for o in owners]
    offsets, total = _offsets([a.nbytes for a in arrays])
    buffer = empty_array(total)
    del arrays
    trimmer = HeapTrimmer()  # the originals' heap pages back to the OS as the arena fills
    for owner, offset in zip(owners, offsets, strict=True):
        original = getattr(owner, attribute)
        copy = buffer[offset : offset + original.nbytes].view(original.dtype).reshape(original.shape)
        np.copyto(copy, original)
        setattr(owner, attribute, copy)
        trimmer.add(original.nbytes)


def host_array(packed: np.ndarray | torch.Tensor) -> np.ndarray:
    """A kernel's packed weights as numpy, what the CPU runtime holds (the packers of f32 grids make CPU
    tensors: the same memory, no copy)."""
    return packed if isinstance(packed, np.ndarray) else packed.numpy()


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim). Loading frees each weight's
    f32 copy as soon as it is packed, but glibc keeps freed blocks below its mmap threshold, which grows
    with every big free: loading SmolLM2 with q4 weights left RSS 941 MiB, 456 MiB after this call
    (the model itself holds ~200 MiB). A no-op where there is no malloc_trim."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
