"""FLOPs of a packed micro-batch from its host statistics (``Σ s_i``, ``Σ s_i²``).

In a packed row, attention (``QKᵀ`` and ``PV``) only happens inside each sequence, so
its cost grows with ``Σ s_i²`` over the real lengths, not with ``T²``: treating a pack
of lengths ``[5, 3, 9]`` (T=24) as one sequence would count 576 instead of 115, about 5x
too much. Token-wise layers (QKV/output projections, MLP, logits) grow with ``Σ s_i``.

Conventions (Megatron-LM's): a matmul of ``m x k`` by ``k x n`` is ``2·m·k·n`` FLOPs;
causal attention does half of the full score matrix, which cancels the factor 2 of
``QKᵀ`` + ``PV``, so attention forward per layer is ``2 · Σ s_i² · heads · head_dim``;
the backward pass costs twice the forward (x3 for a training step).

Reporting TFLOP/s correctly (host ints only, no device sync)::

    flops = 0
    for batch in loader:                       # THDBatch, stats are Python ints
        loss = step(batch)
        flops += training_flops(batch.num_real_tokens, batch.seqlen_sq_sum,
                                num_layers=32, hidden_size=4096, num_heads=32,
                                head_dim=128, ffn_hidden_size=14336,
                                num_query_groups=8, vocab_size=128256)
    # once per logging interval: sum `flops` over data-parallel ranks, then
    tflops_per_gpu = flops / elapsed_seconds / world_size / 1e12

Under CP (and TP/PP) every rank of a data-parallel replica sees the same statistics
(they describe the whole pack), so count each micro-batch once per replica.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PackFlops:
    """Forward FLOPs of one micro-batch, split by kind (multiply by 3 for fwd+bwd)."""

    attention: int
    """Core attention (scores and weighted sum) over all layers: ``2·Σs²·heads·head_dim·layers``."""
    linear: int
    """Token-wise matmuls over all layers plus the logits: proportional to ``Σ s_i``."""

    @property
    def forward(self) -> int:
        return self.attention + self.linear

    @property
    def training(self) -> int:
        """Forward + backward (backward = 2x forward)."""
        return 3 * self.forward


def attention_flops(seqlen_sq_sum: int, num_heads: int, head_dim: int, num_layers: int = 1) -> int:
    """Causal attention forward FLOPs: ``2 · Σ s_i² · heads · head_dim`` per layer."""
    return 2 * int(seqlen_sq_sum) * num_heads * head_dim * num_layers


def linear_flops(
    num_tokens: int,
    hidden_size: int,
    num_heads: int,
    head_dim: int,
    *,
    num_layers: int = 1,
    ffn_hidden_size: int | None = None,
    num_query_groups: int | None = None,
    gated_mlp: bool = True,
    vocab_size: int = 0,
) -> int:
    """Forward FLOPs of the token-wise matmuls for ``num_tokens`` real tokens.

    Per layer and token: QKV projection ``2·h·(heads + 2·groups)·head_dim``, output
    projection ``2·heads·head_dim·h``, MLP ``2·h·ffn·(3 if gated else 2)``; plus the
    logits ``2·h·vocab`` once per token.
    """
    ffn = ffn_hidden_size if ffn_hidden_size is not None else 4 * hidden_size
    groups = num_query_groups if num_query_groups is not None else num_heads
    qkv = 2 * hidden_size * (num_heads + 2 * groups) * head_dim
    proj = 2 * num_heads * head_dim * hidden_size
    mlp = 2 * hidden_size * ffn * (3 if gated_mlp else 2)
    per_token = num_layers * (qkv + proj + mlp) + 2 * hidden_size * vocab_size
    return int(num_tokens) * per_token


def pack_flops(
    num_real_tokens: int,
    seqlen_sq_sum: int,
    *,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    head_dim: int | None = None,
    ffn_hidden_size: int | None = None,
    num_query_groups: int | None = None,
    gated_mlp: bool = True,
    vocab_size: int = 0,
) -> PackFlops:
    """Forward FLOPs of a micro-batch from its ``num_real_tokens`` and ``seqlen_sq_sum``."""
    d = head_dim if head_dim is not None else hidden_size // num_heads
    return PackFlops(
        attention=attention_flops(seqlen_sq_sum, num_heads, d, num_layers),
        linear=linear_flops(
            num_real_tokens,
            hidden_size,
            num_heads,
            d,
            num_layers=num_layers,
            ffn_hidden_size=ffn_hidden_size,
            num_query_groups=num_query_groups,
            gated_mlp=gated_mlp,
            vocab_size=vocab_size,
        ),
    )


def training_flops(num_real_tokens: int, seqlen_sq_sum: int, **model: int | bool | None) -> int:
    """Forward + backward FLOPs of a micro-batch (``3 ×`` :func:`pack_flops`)."""
    return pack_flops(num_real_tokens, seqlen_sq_sum, **model).training  # type: ignore[arg-type]


@dataclass(frozen=True)
class FlopsCost:
    """Training FLOPs of packs as a cost for ``THDLoader(balance=...)``, from arrays of their
    ``num_real_tokens`` and ``seqlen_sq_sum``: ``per_token · tokens + per_square · Σs²``.

    Built by :func:`flops_cost` from a model's shape; the two coefficients are
    :func:`training_flops` of one token and of one unit of ``Σ s_i²``, which it is linear in."""

    per_token: int
    per_square: int

    def __call__(self, num_real_tokens, seqlen_sq_sum):
        import numpy as np

        return (self.per_token * np.asarray(num_real_tokens, dtype=np.float64)
                + self.per_square * np.asarray(seqlen_sq_sum, dtype=np.float64))


def flops_cost(**model: int | bool | None) -> FlopsCost:
    """The cost of a pack in training FLOPs for the model ``model`` describes (the keywords of
    :func:`pack_flops`), for balancing data-parallel ranks::

        THDLoader(ds, dp_size=dp, dp_rank=rank, micro_batches_per_step=8,
                  balance=flops_cost(num_layers=32, hidden_size=4096, num_heads=32, head_dim=128,
                                     ffn_hidden_size=14336, num_query_groups=8, vocab_size=128256))
    """
    return FlopsCost(per_token=training_flops(1, 0, **model), per_square=training_flops(0, 1, **model))
