"""Copy batch ``k+1`` to the GPU on a side CUDA stream while batch ``k`` computes.

The pattern (NVIDIA Apex's ``data_prefetcher``, timm's ``PrefetchLoader``), with the one
step those examples leave out:

1. the DataLoader hands over pinned CPU batches (``pin_memory=True``), so
   ``.to(device, non_blocking=True)`` is a real asynchronous DMA;
2. the copies are issued on a dedicated ``copy_stream``, one batch ahead;
3. before a batch is used, the compute stream waits for the copy stream
   (``wait_stream``: a GPU-side dependency, not a host sync);
4. ``record_stream`` marks each tensor as used by the compute stream, so the caching
   allocator does not hand its memory to the next copy while kernels still read it.

No step here reads a device value, so iterating never blocks the host on the GPU and
works under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from packer_cli.torch.batch import THDBatch


def cuda_prefetch(batches: Iterable[THDBatch], device: torch.device) -> Iterator[THDBatch]:
    """Yield ``batches`` moved to ``device``, keeping one copy in flight on a side stream.

    Fetching batch ``k+1`` runs before batch ``k`` is handed over; an error there (a damaged
    pack's ``DataError``, a worker's failure, an out-of-memory copy) is raised only after batch
    ``k`` has been served, as the CPU path raises it, so a loop that skips a bad pack by its
    position loses no good one.
    """
    copy_stream = torch.cuda.Stream(device=device)
    source = iter(batches)

    def issue() -> THDBatch | None:
        cpu = next(source, None)
        if cpu is None:
            return None
        with torch.cuda.stream(copy_stream):
            return cpu.to(device, non_blocking=True)

    ahead = issue()
    while ahead is not None:
        compute = torch.cuda.current_stream(device)
        compute.wait_stream(copy_stream)
        current = ahead
        current.record_stream(compute)
        try:
            ahead = issue()  # overlap the next copy with this step
        except Exception as error:
            yield current
            raise error
        yield current
