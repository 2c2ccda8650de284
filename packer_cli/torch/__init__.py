"""PyTorch side of packer: read packed shards as THD batches for Megatron-core, flash-attn and HF.

::

    out/ (packs-*.arrow, metadata.json)
        -> PackedDataset            one pack -> THDBatch (CPU, memory-mapped read)
        -> THDLoader                shuffle, DP shard, CP slice in workers, pinned,
                                    side-stream prefetch -> THDBatch on the GPU
        -> batch.packed_seq_params()   Megatron-core / Transformer Engine
           batch.flash_attn_kwargs()   flash_attn_varlen_func
           batch.hf_kwargs()           Hugging Face padding-free causal LM

Example::

    from packer_cli.torch import PackedDataset, THDLoader
    loader = THDLoader(PackedDataset("out/"), cp_size=2, cp_rank=0, seed=1)
    for batch in loader:
        logits = model(batch.tokens, position_ids=batch.position_ids,
                       packed_seq_params=batch.packed_seq_params())

Also: :func:`cp_partition_indices` (TE's CP zig-zag in pure torch),
:func:`pack_batch_sequences` (in-batch packing for VLMs), :func:`validate_training_config`
(Megatron-Bridge's config rules) and :mod:`packer_cli.torch.flops` (``Σ s_i²`` FLOPs).

Only this package imports torch; the CLI never does.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "packer_cli.torch needs PyTorch, which is not installed: pip install 'packer-cli[torch]'"
    ) from exc

from packer_cli.torch.batch import THDBatch
from packer_cli.torch.build import StaticShapeError
from packer_cli.torch.config import TrainingConfigError, pad_multiple, validate_training_config
from packer_cli.torch.cp import check_cp_boundaries, cp_partition_indices
from packer_cli.torch.dataset import PackedDataset
from packer_cli.torch.flops import FlopsCost, PackFlops, attention_flops, flops_cost, pack_flops, training_flops
from packer_cli.torch.in_batch import pack_batch_sequences
from packer_cli.torch.loader import THDLoader
from packer_cli.torch.params import PackedSeqParams

__all__ = [
    "FlopsCost",
    "PackFlops",
    "PackedDataset",
    "PackedSeqParams",
    "StaticShapeError",
    "THDBatch",
    "THDLoader",
    "TrainingConfigError",
    "attention_flops",
    "check_cp_boundaries",
    "cp_partition_indices",
    "flops_cost",
    "pack_batch_sequences",
    "pack_flops",
    "pad_multiple",
    "training_flops",
    "validate_training_config",
]
