"""How a CPU :class:`~packer_cli.torch.batch.THDBatch` crosses a process boundary: one buffer.

A DataLoader worker hands each batch to the main process through a multiprocessing queue.
torch pickles every tensor there by moving its storage into a shared-memory segment of its
own and passing that segment's file descriptor over a socket, which costs about half a
millisecond a tensor whatever its size. A batch holds eight or nine tensors of a few
kilobytes each, so that was ~5 ms a batch: one worker delivered 200-280 batches a second
to the training loop while building 2,600-3,000 (the benchmark's 4096-token packs, CP=2).

Pickled here instead, a batch is its host fields, a small layout and one ``bytearray``
holding every tensor's bytes (each at a 64-byte aligned offset). That goes through the
queue's pipe as plain bytes, one copy, and the receiving side rebuilds the tensors as
views into it: 800-1,200 batches a second with one worker on the same data, and the main
process's CPU per batch fell from 1.6-2.4 ms to 0.24-0.36 ms (``benchmarks/bench_loader.py``).
Only CPU batches take this path (``THDBatch.__reduce__``); a batch with tensors on another
device pickles field by field, each tensor by torch's own rules.
"""
from __future__ import annotations

import numpy as np
import torch

ALIGN = 64  # bytes: every tensor starts where any dtype's view may start


def to_wire(fields: dict, tensor_names: list[str]) -> tuple[dict, list, bytearray]:
    """``(host fields, layout, payload)`` of ``fields``, whose ``tensor_names`` are CPU tensors:
    those go into the payload, every other field stays in the host fields as it is."""
    # Each tensor's bytes as NumPy (the copies below cost less there than as torch ops); the
    # uint8 view first, so that dtypes NumPy lacks (bfloat16) travel too.
    raw = [fields[n].detach().contiguous().reshape(-1).view(torch.uint8).numpy() for n in tensor_names]
    layout, size = [], 0
    for name, data in zip(tensor_names, raw):
        tensor = fields[name]
        layout.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), size, data.size))
        size += -(-data.size // ALIGN) * ALIGN
    payload = bytearray(size)
    flat = np.frombuffer(payload, np.uint8)
    for (_, _, _, offset, nbytes), data in zip(layout, raw):
        flat[offset:offset + nbytes] = data
    host = {k: v for k, v in fields.items() if k not in tensor_names}
    return host, layout, payload


def from_wire(host: dict, layout: list, payload: bytearray) -> dict:
    """The fields :func:`to_wire` took apart, every tensor a view into ``payload``."""
    flat = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
    fields = dict(host)
    for name, dtype, shape, offset, nbytes in layout:
        fields[name] = flat[offset:offset + nbytes].view(getattr(torch, dtype)).reshape(shape)
    return fields
