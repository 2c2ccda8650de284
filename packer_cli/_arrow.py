"""Zero-copy NumPy ↔ Arrow for fixed-width integer arrays, without pyarrow's pandas probe, 0/1
masks ↔ Arrow boolean bitmaps, and the memory pool packer's own Arrow allocations come from.

``pa.array(ndarray)``, ``Array.to_numpy()`` and ``np.asarray(arrow_array)`` import pandas the
first time they run when pandas is installed (to check whether the object is a pandas one),
which costs about 0.25 s of every ``packer`` start. These two helpers go through the buffers
directly; both are views, nothing is copied. A boolean array is a bitmap (one bit a value,
least significant bit first), so :func:`bits_from_numpy` packs and :func:`bits_to_numpy` unpacks.

>>> import numpy as np
>>> to_numpy(from_numpy(np.arange(3, dtype=np.int32))).tolist()
[0, 1, 2]
>>> bits_to_numpy(bits_from_numpy(np.array([1, 0, 1, 1], np.uint8)), 1, 4).tolist()
[0, 1, 1]
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import pyarrow as pa


@lru_cache(maxsize=1)
def memory_pool() -> pa.MemoryPool:
    """jemalloc's pool where pyarrow has it, else the system allocator's.

    packer's buffers (decompressed Parquet pages, scanned JSON values, gather buffers) are
    allocated on one thread and freed on another. pyarrow's default pool (mimalloc in current
    wheels) keeps such memory in per-thread heaps and let pass one's resident size wander
    60-70 MB above jemalloc's on the benchmark input, and grow with the length of the run
    (``benchmarks/bench_memory.py``); speed is the same.
    """
    try:
        return pa.jemalloc_memory_pool()
    except NotImplementedError:  # a pyarrow built without jemalloc (e.g. on Windows)
        return pa.system_memory_pool()


def from_numpy(values: np.ndarray) -> pa.Array:
    """An Arrow array viewing a 1-D integer ``values`` (no nulls)."""
    values = np.ascontiguousarray(values)
    if values.dtype.kind not in "iu":
        return pa.array(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), values.size, [None, pa.py_buffer(values)])


def numpy_dtype(type_: pa.DataType) -> np.dtype:
    """The NumPy dtype of a fixed-width integer, floating or boolean Arrow type.

    ``DataType.to_pandas_dtype()`` gives the same, but pyarrow before 15 needs pandas for it:
    without pandas installed it raised ModuleNotFoundError."""
    if pa.types.is_integer(type_):
        return np.dtype(f"{'u' if pa.types.is_unsigned_integer(type_) else 'i'}{type_.bit_width // 8}")
    if pa.types.is_floating(type_):
        return np.dtype(f"f{type_.bit_width // 8}")
    if pa.types.is_boolean(type_):
        return np.dtype(np.bool_)
    return np.dtype(type_.to_pandas_dtype())


def to_numpy(arr: pa.Array) -> np.ndarray:
    """A read-only NumPy view of an integer Arrow array without nulls."""
    if not pa.types.is_integer(arr.type) or arr.null_count:
        return np.asarray(arr.to_numpy(zero_copy_only=False))
    dtype = numpy_dtype(arr.type)
    if len(arr) == 0:
        return np.empty(0, dtype=dtype)
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * dtype.itemsize)


def bits_from_numpy(mask: np.ndarray) -> pa.BooleanArray:
    """A boolean Arrow array (no nulls) of a 0/1 ``mask``, packed 8 values a byte."""
    mask = np.ascontiguousarray(mask)
    bitmap = np.packbits(mask.view(np.uint8) if mask.dtype == np.bool_ else mask, bitorder="little")
    return pa.Array.from_buffers(pa.bool_(), int(mask.size), [None, pa.py_buffer(bitmap)])


def list_array(offsets: np.ndarray, values: np.ndarray, type_: pa.DataType) -> pa.ListArray:
    """A list column of ``type_`` values over NumPy ``offsets`` and flat ``values`` (viewed, not
    copied, where the dtypes already match); ``pa.bool_()`` packs 0/1 ``values`` into a bitmap."""
    if pa.types.is_boolean(type_):
        values = bits_from_numpy(values)
    else:
        values = from_numpy(np.asarray(values).astype(numpy_dtype(type_), copy=False))
    return pa.ListArray.from_arrays(from_numpy(np.asarray(offsets).astype(np.int32, copy=False)), values)


def bitmap_of(arr: pa.BooleanArray) -> tuple[np.ndarray, int]:
    """The bytes of a boolean Arrow array's bitmap (a view) and the bit its first value is at."""
    buffer = arr.buffers()[1]
    if buffer is None or len(arr) == 0:
        return np.zeros(0, dtype=np.uint8), 0
    return np.frombuffer(buffer, dtype=np.uint8), arr.offset


def unpack_bits(bitmap: np.ndarray, first: int, last: int) -> np.ndarray:
    """Bits ``first:last`` of ``bitmap`` as uint8 0/1 (a copy); only the bytes holding them
    are unpacked, so a pack's slice of a record batch costs what the pack holds."""
    if last <= first:
        return np.zeros(0, dtype=np.uint8)
    lo = first >> 3
    return np.unpackbits(bitmap[lo:(last + 7) >> 3], bitorder="little")[first - (lo << 3):last - (lo << 3)]


def bits_to_numpy(arr: pa.BooleanArray, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Values ``start:stop`` of a boolean Arrow array without nulls, as uint8 0/1 (a copy)."""
    bitmap, offset = bitmap_of(arr)
    return unpack_bits(bitmap, offset + start, offset + (len(arr) if stop is None else stop))
