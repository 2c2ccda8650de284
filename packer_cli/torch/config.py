"""Training-config checks for packed THD data, with Megatron-Bridge's rules and messages.

A packed run fails late and obscurely when the topology and the data disagree (a CP rank
whose tokens are all masked gives NaN; a sequence not divisible by ``2*CP`` trips a device
assert in TE). :func:`validate_training_config` checks the combination up front. Every
argument is optional where it may be unknown: a check runs only when its inputs are given,
so :class:`~packer_cli.torch.loader.THDLoader` can call it with what it knows (the data's
spec and the CP size) and a trainer can call it again with the full config.

The padding multiple every sequence needs is::

    cp_multiple = 2 * CP if CP > 1 else 1          (zig-zag: 2*CP equal chunks)
    sp_multiple = CP * TP if SP and TP > 1 else 1  (SP scatters T/CP over TP ranks)
    multiple    = lcm(cp_multiple, sp_multiple)    (over the train and eval CP sizes)

Examples: TP4/CP1/SP -> 4; TP2/CP2/SP -> 4; TP8/CP2/SP -> 16; TP4/CP4/SP -> 16.
"""

from __future__ import annotations

import math

from packer_cli.torch._ints import flag, integer

MUTUALLY_EXCLUSIVE = "enable_offline_packing and enable_in_batch_packing are mutually exclusive."
PAD_CU_NEEDS_MAX_LENGTH = "offline_packing_specs.pad_cu_seqlens=True requires dataset pad_to_max_length=True."
GRAPHS_NEED_MAX_LENGTH = "Offline packing with CUDA graphs requires dataset pad_to_max_length=True."
GRAPHS_NEED_PAD_CU = (
    "Packed attention CUDA graphs require offline_packing_specs.pad_cu_seqlens=True. "
    "Enable it for full-iteration, whole-layer, or attention-scoped capture."
)
CP_SEQ_LENGTH = "Sequence length must be divisible by 2 * context parallel size if context parallel is used."
CP_PER_TOKEN_LOSS = "When finetuning with CP>1, calculate_per_token_loss must be True"
CP_AVG_IN_COLLECTIVE = "When finetuning with CP>1, average_in_collective must be False"
IN_BATCH_MBS = (
    "micro_batch_size should be greater than 1 when using enable_in_batch_packing=True. "
    "In-batch packing concatenates multiple sequences within a microbatch, so at least 2 sequences "
    "are required per micro-batch."
)
PACKED_SEQUENCE_DOCS = "https://docs.nvidia.com/nemo-framework/user-guide/latest/sft_peft/packed_sequence.html"

#: Model families whose packed fine-tuning Bridge disables: (family, path) -> reason.
_FAMILY_OPT_OUTS = {
    ("qwen3-next", "offline"): "Qwen3-Next SFT",
    ("qwen3-next", "in_batch"): "Qwen3-Next SFT",
    ("glm-4.5", "offline"): "GLM-4.5 SFT/PEFT",
    ("glm-4.5", "in_batch"): "GLM-4.5 SFT/PEFT",
    ("qwen3.5-vl", "in_batch"): "Qwen3.5-VL in-batch",
}


class TrainingConfigError(ValueError):
    """A training configuration that packed THD data cannot run with."""


def _parallel_size(value, name: str, none: bool = False) -> int | None:
    """A parallel size as an int >= 1 (None passes where ``none``); TrainingConfigError otherwise
    (a 0 or a float gave a padding multiple of 0 or 1 without a word)."""
    if none and value is None:
        return None
    size = integer(value)
    if size is None or size < 1:
        raise TrainingConfigError(f"{name} must be an integer >= 1{' or None' if none else ''}, got {value!r}")
    return size


def _sp_flag(value) -> bool:
    """The SP flag as a bool; TrainingConfigError otherwise (``"false"`` gave SP's multiple)."""
    try:
        return flag(value, "sequence_parallel")
    except ValueError as exc:
        raise TrainingConfigError(str(exc)) from None


def pad_multiple(cp: int = 1, tp: int = 1, sequence_parallel: bool = False, eval_cp: int | None = None) -> int:
    """Per-sequence padding multiple ``lcm(2*CP, CP*TP with SP)`` over train and eval CP.

    ``cp``, ``tp`` and ``eval_cp`` (None: the training CP) are integers >= 1 and
    ``sequence_parallel`` a bool; anything else is a :class:`TrainingConfigError`."""
    cp, tp, eval_cp = _parallel_size(cp, "cp"), _parallel_size(tp, "tp"), _parallel_size(eval_cp, "eval_cp", True)
    sequence_parallel = _sp_flag(sequence_parallel)
    cps = {cp} | ({eval_cp} if eval_cp else set())
    parts = [2 * c if c > 1 else 1 for c in cps]
    parts += [c * tp if sequence_parallel and tp > 1 else 1 for c in cps]
    return math.lcm(*parts)


def _family_key(model_family: str) -> str:
    key = model_family.lower().replace("_", "-").replace(" ", "-")
    key = key.replace("qwen3-5", "qwen3.5").replace("glm-4-5", "glm-4.5").replace("glm4.5", "glm-4.5")
    key = key.replace("glm45", "glm-4.5").replace("qwen3next", "qwen3-next").replace("qwen35", "qwen3.5")
    for family in ("qwen3-next", "glm-4.5", "qwen3.5-vl"):
        if key.startswith(family):
            return family
    return key


def _mbs_message(mbs: int, global_batch_size: int | None, pack_size: int | None) -> str:
    gbs = global_batch_size if global_batch_size is not None else mbs
    size = pack_size if pack_size is not None else 0
    return (
        "Micro batch size should be 1 when training with packed sequence, but your micro batch size "
        f"is {mbs}. \nThe following config is equivalent to your current setting for "
        "a packed dataset. Please update your config to the following: \n"
        f"Set micro batch size to 1 (currently {mbs})\n"
        f"Set global batch size to {gbs // mbs} (currently {gbs}) \n"
        f"Set packed sequence length to {size * mbs} (currently {size}) \n"
        f"For details please visit {PACKED_SEQUENCE_DOCS}"
    )


def validate_training_config(
    *,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    global_batch_size: int | None = None,
    context_parallel_size: int = 1,
    eval_context_parallel_size: int | None = None,
    tensor_model_parallel_size: int = 1,
    sequence_parallel: bool = False,
    offline_packing: bool = False,
    in_batch_packing: bool = False,
    pack_size: int | None = None,
    pad_to_max_length: bool | None = None,
    pad_cu_seqlens: bool = False,
    data_pad_multiple: int | None = None,
    cuda_graphs: bool = False,
    cuda_graph_captures_attention: bool = True,
    finetuning: bool = True,
    calculate_per_token_loss: bool | None = None,
    average_in_collective: bool | None = None,
    model_family: str | None = None,
) -> int:
    """Raise :class:`TrainingConfigError` (a ``ValueError``) on the first rule broken.

    Rules, checked in this order (messages are Bridge's where it has one):

    1. offline and in-batch packing are mutually exclusive;
    2. ``pad_cu_seqlens`` requires ``pad_to_max_length``; CUDA graphs with offline
       packing require ``pad_to_max_length`` and, when they capture attention,
       ``pad_cu_seqlens``;
    3. for in-batch packing, ``seq_length`` must be a multiple of :func:`pad_multiple`;
    4. with CP > 1, ``seq_length`` divisible by ``2*CP``; fine-tuning needs per-token loss
       and no ``average_in_collective`` (else ranks whose tokens are all masked give NaN);
    5. offline packing requires micro-batch 1; in-batch packing requires micro-batch > 1;
    6. the offline data's padding multiple must be a multiple of :func:`pad_multiple`;
    7. the model-family opt-outs (Qwen3-Next SFT, GLM-4.5 SFT/PEFT, Qwen3.5-VL in-batch)
       are rejected. Multi-token prediction is not: Megatron-core rolls its labels within
       each packed sequence, and Bridge refuses MTP only with Energon's native packing,
       which this loader does not do.

    Returns:
        The required per-sequence padding multiple.
    """
    cp = _parallel_size(context_parallel_size, "context_parallel_size")
    tp = _parallel_size(tensor_model_parallel_size, "tensor_model_parallel_size")
    eval_cp = _parallel_size(eval_context_parallel_size, "eval_context_parallel_size", True)
    sequence_parallel = _sp_flag(sequence_parallel)
    if offline_packing and in_batch_packing:
        raise TrainingConfigError(MUTUALLY_EXCLUSIVE)
    if offline_packing and pad_cu_seqlens and pad_to_max_length is False:
        raise TrainingConfigError(PAD_CU_NEEDS_MAX_LENGTH)
    if offline_packing and cuda_graphs:
        if pad_to_max_length is False:
            raise TrainingConfigError(GRAPHS_NEED_MAX_LENGTH)
        if cuda_graph_captures_attention and not pad_cu_seqlens:
            raise TrainingConfigError(GRAPHS_NEED_PAD_CU)

    multiple = pad_multiple(cp, tp, sequence_parallel, eval_cp)
    if in_batch_packing and seq_length is not None and seq_length % multiple:
        raise TrainingConfigError(
            f"seq_length must be divisible by the CP/SP collate padding multiple ({multiple})."
        )
    if cp > 1:
        if seq_length is not None and seq_length % (2 * cp):
            raise TrainingConfigError(CP_SEQ_LENGTH)
        if finetuning and calculate_per_token_loss is False:
            raise TrainingConfigError(CP_PER_TOKEN_LOSS)
        if finetuning and average_in_collective:
            raise TrainingConfigError(CP_AVG_IN_COLLECTIVE)
    if offline_packing and micro_batch_size is not None and micro_batch_size > 1:
        raise TrainingConfigError(_mbs_message(micro_batch_size, global_batch_size, pack_size))
    if in_batch_packing and micro_batch_size == 1:
        raise TrainingConfigError(IN_BATCH_MBS)
    if offline_packing and data_pad_multiple is not None and data_pad_multiple % multiple:
        raise TrainingConfigError(
            f"the packed data pads sequences to multiples of {data_pad_multiple}, but CP={cp}, "
            f"TP={tp}, SP={sequence_parallel} needs multiples of {multiple}: "
            "repack with this topology (the alignment changes pack membership)"
        )

    path = "offline" if offline_packing else "in_batch" if in_batch_packing else None
    if path and model_family:
        reason = _FAMILY_OPT_OUTS.get((_family_key(model_family), path))
        if reason:
            raise TrainingConfigError(
                f"Sequence packing is disabled for {reason} ({model_family!r}): train without "
                f"{'offline' if path == 'offline' else 'in-batch'} packing for this model family."
            )
    return multiple
