"""validate_training_config: Megatron-Bridge's packing rules and messages."""

import re

import pytest

pytest.importorskip("torch")

from packer_cli.torch import TrainingConfigError, pad_multiple, validate_training_config  # noqa: E402
from packer_cli.torch.config import (  # noqa: E402
    CP_AVG_IN_COLLECTIVE,
    CP_PER_TOKEN_LOSS,
    CP_SEQ_LENGTH,
    GRAPHS_NEED_MAX_LENGTH,
    GRAPHS_NEED_PAD_CU,
    IN_BATCH_MBS,
    MUTUALLY_EXCLUSIVE,
    PAD_CU_NEEDS_MAX_LENGTH,
)


def _raises(message, **kw):
    with pytest.raises(TrainingConfigError, match=re.escape(message)):
        validate_training_config(**kw)


@pytest.mark.parametrize(
    "cp, tp, sp, eval_cp, expected",
    [
        (1, 1, False, None, 1),
        (1, 4, True, None, 4),  # TP4/CP1/SP
        (2, 2, True, None, 4),  # TP2/CP2/SP
        (2, 8, True, None, 16),  # TP8/CP2/SP
        (4, 4, True, None, 16),  # TP4/CP4/SP
        (2, 4, True, None, 8),  # test_enable_in_batch_packing_sets_collate_padding_multiple
        (3, 1, False, None, 6),
        (3, 1, False, 2, 12),  # eval CP joins the lcm
        (2, 4, False, None, 4),  # no SP: TP does not matter
    ],
)
def test_pad_multiple(cp, tp, sp, eval_cp, expected):
    assert pad_multiple(cp, tp, sp, eval_cp) == expected
    assert validate_training_config(
        context_parallel_size=cp, tensor_model_parallel_size=tp, sequence_parallel=sp, eval_context_parallel_size=eval_cp
    ) == expected


CONFIG_NAMES = dict(cp="context_parallel_size", tp="tensor_model_parallel_size", eval_cp="eval_context_parallel_size")


@pytest.mark.parametrize("kwargs, problem", [
    (dict(cp=0), "cp must be an integer >= 1, got 0"),
    (dict(cp=-2), "cp must be an integer >= 1, got -2"),
    (dict(cp=2.0), "cp must be an integer >= 1, got 2.0"),
    (dict(tp=0, sequence_parallel=True), "tp must be an integer >= 1, got 0"),
    (dict(eval_cp=0), "eval_cp must be an integer >= 1 or None, got 0"),
    (dict(cp=2, tp=4, sequence_parallel="false"), "sequence_parallel must be True or False, got 'false'"),
])
def test_bad_topology_values_are_refused(kwargs, problem):
    """They gave multiples of 0 or 1, or SP's multiple for SP="false", without a word."""
    with pytest.raises(TrainingConfigError, match=f"^{problem}$"):
        pad_multiple(**kwargs)
    name = problem.split()[0]
    with pytest.raises(TrainingConfigError, match=f"^{CONFIG_NAMES.get(name, name)}{problem.removeprefix(name)}$"):
        validate_training_config(**{CONFIG_NAMES.get(k, k): v for k, v in kwargs.items()})


@pytest.mark.parametrize("seq_length, cp, ok", [(512, 2, True), (510, 2, False), (256, 3, False), (258, 1, True)])
def test_context_parallel_seq_length_divisibility(seq_length, cp, ok):
    if ok:
        validate_training_config(seq_length=seq_length, context_parallel_size=cp)
    else:
        _raises(CP_SEQ_LENGTH, seq_length=seq_length, context_parallel_size=cp)


def test_context_parallel_finetuning_validations():
    """Per-token loss and no average_in_collective are fine-tuning rules: pretraining with CP>1 and
    average_in_collective=True was refused with the fine-tuning message."""
    _raises(CP_PER_TOKEN_LOSS, context_parallel_size=2, calculate_per_token_loss=False)
    _raises(CP_AVG_IN_COLLECTIVE, context_parallel_size=2, calculate_per_token_loss=True, average_in_collective=True)
    validate_training_config(context_parallel_size=2, calculate_per_token_loss=True, average_in_collective=False)
    # skipped for pretraining and for CP1
    validate_training_config(context_parallel_size=2, finetuning=False, calculate_per_token_loss=False)
    validate_training_config(context_parallel_size=2, finetuning=False, average_in_collective=True)
    validate_training_config(context_parallel_size=1, calculate_per_token_loss=False, average_in_collective=True)


def test_packed_sequence_micro_batch_size():
    """Bridge's message, with the equivalent config worked out from the sizes given."""
    with pytest.raises(TrainingConfigError) as err:
        validate_training_config(offline_packing=True, micro_batch_size=4, global_batch_size=32, pack_size=512)
    msg = str(err.value)
    assert msg.startswith("Micro batch size should be 1 when training with packed sequence, but your micro batch size is 4.")
    assert "Set global batch size to 8 (currently 32)" in msg and "Set packed sequence length to 2048 (currently 512)" in msg
    validate_training_config(offline_packing=True, micro_batch_size=1)
    validate_training_config(offline_packing=False, micro_batch_size=4)  # no packing: no rule
    # without a global batch size the micro-batch is the global one (it was taken as 1: "0 (currently 1)")
    with pytest.raises(TrainingConfigError, match=r"Set global batch size to 1 \(currently 4\) \n"):
        validate_training_config(offline_packing=True, micro_batch_size=4, pack_size=512)


def test_in_batch_packing_micro_batch_size():
    _raises(IN_BATCH_MBS, in_batch_packing=True, micro_batch_size=1)
    validate_training_config(in_batch_packing=True, micro_batch_size=4)


def test_in_batch_seq_length_must_fit_the_collate_multiple():
    _raises(
        "seq_length must be divisible by the CP/SP collate padding multiple (8).",
        in_batch_packing=True, micro_batch_size=2, seq_length=4100, context_parallel_size=2,
        tensor_model_parallel_size=4, sequence_parallel=True,
    )  # fmt: skip


def test_offline_and_in_batch_are_mutually_exclusive():
    _raises(MUTUALLY_EXCLUSIVE, offline_packing=True, in_batch_packing=True, micro_batch_size=2)


def test_pad_cu_seqlens_requires_fixed_token_width():
    """Only a pad_to_max_length given as False is refused: one not given (None, unknown) was refused too."""
    _raises(PAD_CU_NEEDS_MAX_LENGTH, offline_packing=True, pad_cu_seqlens=True, pad_to_max_length=False)
    validate_training_config(offline_packing=True, pad_cu_seqlens=True, pad_to_max_length=True)
    validate_training_config(offline_packing=True, pad_cu_seqlens=True)  # pad_to_max_length unknown: no check


@pytest.mark.parametrize(
    "captures_attention, pad_cu, pad_max, message",
    [
        (True, False, True, GRAPHS_NEED_PAD_CU),  # attention-scoped / full-iteration capture
        (False, False, False, GRAPHS_NEED_MAX_LENGTH),  # mlp-only still needs fixed width
        (False, False, True, None),  # mlp-only does not need padded cu_seqlens
        (True, True, True, None),
        (True, True, None, None),  # pad_to_max_length unknown: not checked (it was refused as False)
    ],
)
def test_cuda_graphs(captures_attention, pad_cu, pad_max, message):
    """Graphs need a fixed width, and padded cu_seqlens when they capture attention; a width not
    given (None) is not checked (it was refused as if False)."""
    kw = dict(
        offline_packing=True, cuda_graphs=True, cuda_graph_captures_attention=captures_attention,
        pad_cu_seqlens=pad_cu, pad_to_max_length=pad_max,
    )  # fmt: skip
    if message:
        _raises(message, **kw)
    else:
        validate_training_config(**kw)


def test_data_multiple_must_match_topology():
    """The offline data's padding multiple must be a multiple of the topology's, for offline packing only."""
    _raises("needs multiples of 8", offline_packing=True, data_pad_multiple=4, context_parallel_size=4)
    validate_training_config(offline_packing=True, data_pad_multiple=16, context_parallel_size=4)
    # the offline data's multiple: ignored for in-batch packing (it was checked, and refused, there too)
    validate_training_config(in_batch_packing=True, micro_batch_size=2, data_pad_multiple=4, context_parallel_size=4)


def test_multi_token_prediction_is_not_a_config_packing_refuses():
    """Bridge refuses MTP only with Energon's native packing: packer refused it for offline and
    in-batch packing, which Bridge (and Megatron-core's packed roll of MTP labels) accept."""
    with pytest.raises(TypeError, match="mtp_num_layers"):
        validate_training_config(offline_packing=True, mtp_num_layers=1)


@pytest.mark.parametrize(
    "family, offline, in_batch, rejected",
    [
        ("Qwen3-Next-80B-A3B", True, False, True),
        ("qwen3_next", False, True, True),
        ("GLM-4.5-Air", True, False, True),
        ("glm45", True, False, True),
        ("Qwen3.5-VL-7B", False, True, True),
        ("Qwen3.5-VL-7B", True, False, False),  # only in-batch is disabled for Qwen3.5-VL
        ("Llama-3.1-8B", True, False, False),
    ],
)
def test_model_family_opt_outs(family, offline, in_batch, rejected):
    """Bridge's opt-outs, and a message naming the path to turn off (an in-batch one said offline)."""
    kw = dict(model_family=family, offline_packing=offline, in_batch_packing=in_batch, micro_batch_size=1 if offline else 2)
    if rejected:
        # the message names the packing path to turn off (in-batch was called offline)
        path = "offline" if offline else "in-batch"
        _raises("Sequence packing is disabled for", **kw)
        message = f"({family!r}): train without {path} packing for this model family."
        with pytest.raises(TrainingConfigError, match=re.escape(message)):
            validate_training_config(**kw)
    else:
        validate_training_config(**kw)


def test_error_is_a_value_error():
    assert issubclass(TrainingConfigError, ValueError)
