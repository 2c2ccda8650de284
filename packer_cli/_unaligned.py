"""Unaligned integer loads and stores for compiled kernels.

Byte-packed layouts put integers at any byte address: the spill's bit-packed tokens (``b``
bits each, see :mod:`packer_cli.shards._gather`), a Parquet page's values, the digits of a
JSON line. Each of these compiles to one unaligned load or store (x86-64 and ARM64 allow
them), where spelling the integer out byte by byte costs an instruction a byte. Addresses are
raw (``array.ctypes.data + offset``); the caller keeps them inside the array.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic


def _load_codegen(bits: int):
    def codegen(context, builder, signature, args):
        return builder.load(builder.inttoptr(args[0], ir.IntType(bits).as_pointer()), align=1)

    return codegen


def _store_codegen(bits: int):
    def codegen(context, builder, signature, args):
        builder.store(args[1], builder.inttoptr(args[0], ir.IntType(bits).as_pointer()), align=1)
        return context.get_dummy_value()

    return codegen


@intrinsic
def load_u32(typingctx, address):
    """The 4 bytes at ``address`` as a little-endian uint32."""
    return types.uint32(types.uint64), _load_codegen(32)


@intrinsic
def load_u64(typingctx, address):
    """The 8 bytes at ``address`` as a little-endian uint64."""
    return types.uint64(types.uint64), _load_codegen(64)


@intrinsic
def store_u32(typingctx, address, value):
    """Write ``value`` (uint32) as the 4 bytes at ``address``."""
    return types.void(types.uint64, types.uint32), _store_codegen(32)


@intrinsic
def store_u64(typingctx, address, value):
    """Write ``value`` (uint64) as the 8 bytes at ``address``."""
    return types.void(types.uint64, types.uint64), _store_codegen(64)
