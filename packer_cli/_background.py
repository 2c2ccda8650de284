"""Run a producer on a background thread, handing its items over through a bounded queue.

The pipeline uses it to overlap stages on two cores: reading and validating the next batch
while the main thread spills the previous one (pass one of ``pack``, and verify's replay of
the source). Pass two overlaps its stages otherwise (the shard sink's I/O thread writes one
buffer while the gather fills the next). The heavy work on both sides (Parquet decoding,
numba kernels, file writes, hashing) releases the GIL.

>>> list(background(iter(range(3))))
[0, 1, 2]
"""
from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_DONE = object()


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


#: How long a consumer that stops early waits for the producer to notice. A producer blocked in
#: the kernel (opening a FIFO no one writes, reading a hung network mount) never does; it is a
#: daemon thread, left behind so that an error or Ctrl-C still unwinds the caller.
ABANDON_AFTER_S = 5.0


def background(items: Iterator[T], depth: int = 2) -> Iterator[T]:
    """Yield ``items`` in order, computed ahead on a thread (at most ``depth`` waiting).

    An exception raised by the producer is re-raised unchanged in the consumer, after the items
    produced before it. When the consumer stops early (an error, or ``close()``), the producer
    is told to stop and joined, so no thread outlives the call, unless it is blocked in a
    system call for longer than :data:`ABANDON_AFTER_S` (then it is left to end on its own).
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            put(_Failed(exc))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=run, name="packer-background", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.exc
            yield item
    finally:
        stop.set()
        thread.join(ABANDON_AFTER_S)


def ordered_map(fn: Callable[[T], R], items: Iterable[T], workers: int = 2, ahead: int = 3,
                pool: Executor | None = None) -> Iterator[R]:
    """``map(fn, items)`` on ``workers`` threads, yielded in order, at most ``ahead`` computed ahead.

    For work that releases the GIL (compiled kernels, I/O). An exception from ``fn`` is
    re-raised in the consumer at its item's turn; stopping early cancels what has not started.
    With ``pool``, the work runs on that executor (shared with other maps, left running) and
    ``workers`` is ignored; stopping early still waits for this map's started items.

    >>> list(ordered_map(lambda x: x * x, range(5)))
    [0, 1, 4, 9, 16]
    """
    own = pool is None
    if own:
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="packer-worker")
    pending: deque = deque()
    todo = iter(items)
    try:
        for item in todo:
            pending.append(pool.submit(fn, item))
            if len(pending) >= ahead:
                break
        while pending:
            result = pending.popleft().result()
            for item in todo:
                pending.append(pool.submit(fn, item))
                break
            yield result
    finally:
        if own:
            pool.shutdown(wait=True, cancel_futures=True)
        else:
            for future in pending:
                future.cancel()
            wait(pending)
