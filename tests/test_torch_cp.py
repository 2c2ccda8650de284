"""cp_partition_indices: TE's dual-chunk (zig-zag) CP split, in pure torch."""

import pytest

torch = pytest.importorskip("torch")

from packer_cli.torch import check_cp_boundaries, cp_partition_indices  # noqa: E402
from packer_cli.torch.cp import cp_partition_reference  # noqa: E402


@pytest.mark.parametrize(
    "cu, total, cp, rank, expected",
    [
        # thd_layout §3.3 worked example: lengths [5, 3, 9] padded to [8, 4, 12]
        ([0, 8, 12, 24], 24, 2, 0, [0, 1, 6, 7, 8, 11, 12, 13, 14, 21, 22, 23]),
        ([0, 8, 12, 24], 24, 2, 1, [2, 3, 4, 5, 9, 10, 15, 16, 17, 18, 19, 20]),
        # static-shape boundaries (repeated last value): rank 0 unchanged
        ([0, 8, 12, 24, 24, 24, 24], 24, 2, 0, [0, 1, 6, 7, 8, 11, 12, 13, 14, 21, 22, 23]),
        # TE unit test test_thd_get_partitioned_indices_matches_dual_chunk_expected_indices
        ([0, 8, 16], 16, 2, 0, [0, 1, 6, 7, 8, 9, 14, 15]),
        ([0, 8, 16], 16, 2, 1, [2, 3, 4, 5, 10, 11, 12, 13]),
        # CP=1 is the identity
        ([0, 2, 6], 6, 1, 0, list(range(6))),
        # a single sequence, CP=4: chunks of 1
        ([0, 8], 8, 4, 3, [3, 4]),
        # zero-length segments in the middle
        ([0, 4, 4, 8], 8, 2, 1, [1, 2, 5, 6]),
    ],
)
def test_known_vectors(cu, total, cp, rank, expected):
    idx = cp_partition_indices(torch.tensor(cu, dtype=torch.int32), total, cp, rank)
    assert idx.dtype == torch.int32
    assert idx.tolist() == expected


def _random_cu(gen: torch.Generator, cp: int) -> list[int]:
    """Random boundaries with every segment a multiple of 2*cp, zero-length ones included."""
    n = int(torch.randint(1, 9, (1,), generator=gen))
    chunks = torch.randint(0, 6, (n,), generator=gen) * 2 * cp  # 0 = zero-length segment
    if int(chunks.sum()) == 0:
        chunks[0] = 2 * cp
    cu = [0] + torch.cumsum(chunks, 0).tolist()
    if int(torch.randint(0, 3, (1,), generator=gen)) == 0:
        cu += [cu[-1]] * int(torch.randint(1, 4, (1,), generator=gen))  # static padding
    return cu


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("seed", range(40))
def test_matches_loop_reference_and_partitions(cp, seed):
    gen = torch.Generator().manual_seed(1000 * cp + seed)
    cu = _random_cu(gen, cp)
    total = cu[-1]
    seen = []
    for rank in range(cp):
        idx = cp_partition_indices(torch.tensor(cu, dtype=torch.int32), total, cp, rank)
        assert idx.tolist() == cp_partition_reference(cu, cp, rank)
        assert idx.numel() == total // cp
        seen += idx.tolist()
    assert sorted(seen) == list(range(total))  # the ranks partition the row exactly


def test_int64_input_and_device_of_output():
    cu = torch.tensor([0, 8, 12, 24], dtype=torch.int64)
    idx = cp_partition_indices(cu, 24, 2, 1)
    assert idx.device == cu.device and idx.dtype == torch.int32
    assert idx.tolist() == [2, 3, 4, 5, 9, 10, 15, 16, 17, 18, 19, 20]


@pytest.mark.parametrize(
    "cu, total, cp, rank, match",
    [
        ([0, 8], 8, 2, 2, "cp_rank"),
        ([0, 8], 8, 0, 0, "cp_rank"),
        ([0, 6], 6, 2, 0, r"^total_tokens=6 is not divisible by 2\*cp_size=4$"),
        ([8], 8, 2, 0, "at least 2"),
        ([0, 2, 8], 8, 2, 0, "segments do not split into 4 equal chunks"),
        ([0, 4, 8], 12, 2, 0, "segments do not split into 4 equal chunks"),
        # boundaries that go back: chunks [2, -1, 2] add up to T/CP all the same
        ([0, 8, 4, 12], 12, 2, 0, r"segments do not split into 4 equal chunks each covering total_tokens=12 \(a "
                                  r"segment's chunk is negative: the boundaries decrease\): .*none below the one before"),
        ([0, 8], 8, 2.0, 0, "cp_size must be an integer"),
        ([0, 8], 8, 2, True, "cp_rank one of"),
        ([0, 8], 8.0, 2, 0, "total_tokens must be an integer"),
        # float boundaries were sliced as if they were indices (TE asks for int32)
        ([0.0, 8.0], 8, 2, 0, r"^cu_seqlens_padded must be int32 or int64, got torch.float32$"),
        ([0.0, 8.0], 8, 1, 0, r"^cu_seqlens_padded must be int32 or int64, got torch.float32$"),
    ],
)
def test_bad_arguments(cu, total, cp, rank, match):
    """Each is refused with this message. A total not divisible by 2*CP was reported as segments
    that do not split (the total's own check was done modulo CP), and boundaries that go back,
    whose negative chunks add up to T/CP, gave NumPy's 'repeats may not contain negative values'
    (the negative-count check was dropped), and then 'the runs make 6 entries, not 6'."""
    with pytest.raises(ValueError, match=match):
        cp_partition_indices(torch.tensor(cu), total, cp, rank)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_same_result_no_sync():
    cu = torch.tensor([0, 8, 12, 24, 24], dtype=torch.int32)
    cpu = [cp_partition_indices(cu, 24, 2, r) for r in range(2)]
    cu_dev = cu.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dev = [cp_partition_indices(cu_dev, 24, 2, r) for r in range(2)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(cpu, dev):
        assert b.is_cuda and torch.equal(a, b.cpu())


def test_without_context_parallelism_the_rank_holds_the_whole_row():
    """cp_size 1 is no split at all: odd segments included (they failed as a bare torch error)."""
    for cu, total in (([0, 3, 6], 6), ([0, 2, 7], 7), ([0, 0], 0)):
        idx = cp_partition_indices(torch.tensor(cu, dtype=torch.int32), total, 1, 0)
        assert idx.dtype == torch.int32 and idx.tolist() == list(range(total))


@pytest.mark.parametrize("cu, total, match", [
    ([0, 2, 8], 8, r"^cu_seqlens_padded\[1\] = 2 is not divisible by 2\*cp_size=4: .*--cp 2; in-batch, "
                   r"pad_to_multiple_of=pad_multiple\(cp=2\)\)$"),
    ([0, 4, 8], 12, "^cu_seqlens_padded ends at 8, but total_tokens is 12$"),
    # several bad boundaries: the first is named, not the last (cu_seqlens_padded[2] = 6)
    ([0, 2, 6, 8], 8, r"^cu_seqlens_padded\[1\] = 2 is not divisible by 2\*cp_size=4: "),
])
def test_check_cp_boundaries_names_the_entry(cu, total, match):
    """The message names the first bad boundary (it named the last when several were bad)."""
    check_cp_boundaries(torch.tensor([0, 4, 12]), 12, 2)
    check_cp_boundaries(torch.tensor([0, 3, 7]), 7, 1)  # no CP: any lengths
    for size in (0, 2.0, True):
        with pytest.raises(ValueError, match="cp_size must be an integer >= 1"):
            check_cp_boundaries(torch.tensor([0, 4, 12]), 12, size)
    with pytest.raises(ValueError, match=match):
        check_cp_boundaries(torch.tensor(cu), total, 2)
