"""MicroBatchSampler and THDLoader: sharding, epochs, CP slices, resume, and the no-sync GPU path."""

import itertools
import re
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from packer_cli.torch import PackedDataset, THDLoader, TrainingConfigError  # noqa: E402
from packer_cli.errors import DataError  # noqa: E402
from packer_cli.torch.batch import CP_MBS_ERROR, THDBatch  # noqa: E402
from packer_cli.torch.sampler import MicroBatchSampler  # noqa: E402
from packer_cli.torch.testing import InMemoryReader, make_meta, make_row  # noqa: E402


def _dataset(num_packs=13, multiple=4, cp=2, pack_size=64, pad_to_max_length=False):
    g = torch.Generator().manual_seed(num_packs)
    rows = []
    for k in range(num_packs):
        lengths = torch.randint(2, 14, (3,), generator=g).tolist()
        samples = [torch.randint(1, 99, (n,), generator=g).tolist() for n in lengths]
        rows.append(make_row(samples, multiple=multiple, source_index=[3 * k, 3 * k + 1, 3 * k + 2]))
    meta = make_meta(rows, pack_size=pack_size, multiple=multiple, cp=cp, pad_to_max_length=pad_to_max_length)
    return PackedDataset(InMemoryReader(rows, meta))


def _ids(batches):
    return [b.source_index.tolist() for b in batches]


# ---------------------------------------------------------------------------- sampler
def test_sampler_shards_disjoint_equal_and_deterministic():
    ranks = [list(MicroBatchSampler(23, batch_packs=2, dp_size=3, dp_rank=r, seed=5)) for r in range(3)]
    assert [len(r) for r in ranks] == [3, 3, 3]  # 23 // (2*3); the 5 left over are dropped
    flat = [i for r in ranks for mb in r for i in mb]
    assert len(flat) == len(set(flat)) == 18
    assert all(len(mb) == 2 for r in ranks for mb in r)
    assert ranks[1] == list(MicroBatchSampler(23, batch_packs=2, dp_size=3, dp_rank=1, seed=5))


def test_sampler_epochs_reshuffle_and_seed_matters():
    s = MicroBatchSampler(50, seed=1)
    e0 = list(s)
    s.epoch = 1
    e1 = list(s)
    assert e0 != e1 and sorted(e0) == sorted(e1) == [[i] for i in range(50)]
    assert list(MicroBatchSampler(50, seed=2)) != e0
    assert list(MicroBatchSampler(5, shuffle=False)) == [[0], [1], [2], [3], [4]]


def test_sampler_gives_micro_batch_k_to_rank_k_mod_dp_size():
    """The documented layout, which a resumed job relies on: micro-batch k of the epoch's order
    (packs k·b .. k·b + b - 1) goes to DP rank k % dp_size, as its (k // dp_size)-th."""
    ranks = [list(MicroBatchSampler(10, batch_packs=2, dp_size=2, dp_rank=r, shuffle=False)) for r in range(2)]
    assert ranks == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    order = np.random.default_rng([7, 0]).permutation(23)
    for r in range(3):
        got = list(MicroBatchSampler(23, batch_packs=2, dp_size=3, dp_rank=r, seed=7))
        assert got == [order[2 * k: 2 * k + 2].tolist() for k in range(r, 9, 3)]  # 9 whole micro-batches


@pytest.mark.parametrize("kwargs", [dict(dp_size=2, dp_rank=2), dict(batch_packs=2.5), dict(dp_size=0), dict(batch_packs=0),
                                    dict(dp_size=2.0, dp_rank=1), dict(batch_packs="2"), dict(dp_rank=-1)])
def test_sampler_rejects_bad_sharding(kwargs):
    with pytest.raises(ValueError, match="bad sharding"):
        MicroBatchSampler(10, **kwargs)
    assert MicroBatchSampler(10, batch_packs=np.int64(2), dp_size=np.int64(2), dp_rank=np.int64(1)).per_epoch == 2


# ---------------------------------------------------------------------------- loader on CPU
@pytest.mark.parametrize("num_workers", [0, 2])
def test_cp_ranks_of_a_replica_see_the_same_packs_and_their_slices(num_workers):
    ds = _dataset()
    loaders = [THDLoader(ds, cp_size=2, cp_rank=r, seed=3, device="cpu", num_workers=num_workers) for r in range(2)]
    per_rank = [list(loader) for loader in loaders]
    assert len(per_rank[0]) == len(ds) and _ids(per_rank[0]) == _ids(per_rank[1])
    order = list(loaders[0].sampler.epoch_order(0).tolist())
    for step, (b0, b1) in enumerate(zip(*per_rank)):
        full = ds.micro_batch(order[step])
        assert b0.tokens.shape[1] == b1.tokens.shape[1] == full.num_tokens // 2
        assert torch.equal(b0.tokens, full.for_cp_rank(2, 0).tokens) and torch.equal(b1.labels, full.for_cp_rank(2, 1).labels)
        assert torch.equal(b0.cu_seqlens_padded, full.cu_seqlens_padded) and b0.max_seqlen == full.max_seqlen
        assert type(b0.num_loss_tokens) is int and b0.seqlen_sq_sum == full.seqlen_sq_sum


def test_dp_ranks_get_disjoint_packs():
    ds = _dataset(num_packs=20)
    seen = [_ids(THDLoader(ds, dp_size=2, dp_rank=r, device="cpu", num_workers=0, cp_size=1)) for r in range(2)]
    flat = [i for rank in seen for b in rank for i in b]
    assert len(flat) == len(set(flat)) == 60


def test_batch_packs_concatenates_and_cp_rejects_it():
    ds = _dataset()
    batches = list(THDLoader(ds, batch_packs=3, device="cpu", num_workers=0, seed=1))
    assert len(batches) == 4 and all(b.num_packs == 3 and b.num_seqs == 9 for b in batches)
    assert all(b.cu_seqlens_padded[-1].item() == b.num_tokens == b.tokens.shape[1] for b in batches)
    with pytest.raises(ValueError, match=CP_MBS_ERROR.replace("(", "\\(").replace(")", "\\)")):
        THDLoader(ds, batch_packs=2, cp_size=2, device="cpu")


def test_loader_validates_data_against_cp():
    ds = _dataset(multiple=2, cp=1, pack_size=64)  # sequences aligned to 2, CP=2 needs 4
    with pytest.raises(TrainingConfigError, match="needs multiples of 4"):
        THDLoader(ds, cp_size=2, device="cpu")
    with pytest.raises(TrainingConfigError, match="2 \\* context parallel"):
        THDLoader(_dataset(multiple=12, cp=3, pack_size=60), cp_size=4, device="cpu")


def test_loader_validates_data_against_tp_with_sequence_parallelism():
    """Only CP was checked: data packed for CP 2 alone (multiples of 4) reached a TP 4 run with
    sequence parallelism, whose split of a row over the TP ranks needs multiples of 8."""
    ds = _dataset(multiple=4, cp=2, pack_size=64)
    THDLoader(ds, cp_size=2, tp_size=4, device="cpu", num_workers=0)  # without SP, TP leaves the rows whole
    with pytest.raises(TrainingConfigError, match="CP=2, TP=4, SP=True needs multiples of 8"):
        THDLoader(ds, cp_size=2, tp_size=4, sequence_parallel=True, device="cpu", num_workers=0)
    THDLoader(_dataset(multiple=8, cp=2, pack_size=64), cp_size=2, tp_size=4, sequence_parallel=True,
              device="cpu", num_workers=0)


@pytest.mark.parametrize("dataset", ["packed/", "SUBSET"])
def test_a_loader_over_something_else_than_a_packed_dataset_is_a_type_error(dataset):
    """A path or a Subset failed as a bare AttributeError ('str' object has no attribute 'metadata')."""
    if dataset == "SUBSET":
        dataset = torch.utils.data.Subset(_dataset(num_packs=4), [0, 1])
    with pytest.raises(TypeError, match="THDLoader needs a PackedDataset, got (str|Subset)"):
        THDLoader(dataset, device="cpu")


def test_epochs_and_exact_resume():
    ds = _dataset(num_packs=10)
    ref = THDLoader(ds, seed=9, device="cpu", num_workers=0)
    epoch0, epoch1 = _ids(ref), _ids(ref)  # a finished pass moves to the next permutation
    assert epoch0 != epoch1 and sorted(epoch0) == sorted(epoch1)

    first = THDLoader(ds, seed=9, device="cpu", num_workers=2)
    it = iter(first)
    got = [next(it).source_index.tolist() for _ in range(4)]
    state = first.state_dict()
    assert state["epoch"] == 0 and state["position"] == 4

    resumed = THDLoader(ds, seed=9, device="cpu", num_workers=2)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # the usual loop call keeps the restored position
    got += _ids(resumed)
    assert got == epoch0
    assert resumed.epoch == 1 and _ids(resumed) == epoch1

    with pytest.raises(ValueError, match="seed"):
        THDLoader(ds, seed=1, device="cpu").load_state_dict(state)


@pytest.mark.parametrize("key, other", [("seed", {"seed": 1}), ("dp_size", {"dp_size": 4, "dp_rank": 1}),
                                        ("dp_rank", {"dp_rank": 0}), ("shuffle", {"shuffle": False}),
                                        ("batch_packs", {"batch_packs": 2})])
def test_a_state_saved_by_a_loader_of_other_settings_is_refused(key, other):
    """A state is a position in one rank's sequence of micro-batches: loaded by another rank
    (or another seed, world size, order or micro-batch size), it would resume elsewhere."""
    ds = _dataset(num_packs=12)
    mine = dict(seed=9, dp_size=2, dp_rank=1, device="cpu", num_workers=0)
    loader = THDLoader(ds, **mine)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    elsewhere = THDLoader(ds, **{**mine, **other})
    with pytest.raises(ValueError, match=f"loader state has {key}="):
        elsewhere.load_state_dict(state)
    THDLoader(ds, **mine).load_state_dict(state)


@pytest.mark.parametrize("change,says", [
    ({"position": -5}, "position must be an integer >= 0, got -5"),
    ({"position": 5.7}, "position must be an integer >= 0, got 5.7"),
    ({"position": 11}, "position=11, past the 10 micro-batches of an epoch"),
    ({"epoch": -1}, "epoch must be an integer >= 0, got -1"),
    ({"epoch": None}, "epoch must be an integer >= 0, got None"),
])
def test_a_state_that_would_resume_elsewhere_is_refused(change, says):
    """A negative position used to replay the epoch's last micro-batches, one past the end to
    skip to the next epoch, a float to be truncated: each is a ValueError now."""
    ds = _dataset(num_packs=10)
    loader = THDLoader(ds, seed=9, device="cpu", num_workers=0)
    state = {**loader.state_dict(), **change}
    with pytest.raises(ValueError, match=re.escape(says)):
        loader.load_state_dict(state)
    state.pop("epoch")
    with pytest.raises(ValueError, match="loader state has no epoch"):
        loader.load_state_dict(state)
    with pytest.raises(ValueError, match="epoch must be an integer >= 0"):
        loader.set_epoch(-3)
    loader.load_state_dict({**loader.state_dict(), "epoch": np.int64(2), "position": 10})  # NumPy ints, the end


def test_set_epoch_selects_permutation():
    ds = _dataset(num_packs=10)
    a = THDLoader(ds, seed=4, device="cpu", num_workers=0)
    a.set_epoch(3)
    b = THDLoader(ds, seed=4, device="cpu", num_workers=0)
    for _ in range(3):
        list(b)
    assert _ids(a) == _ids(b) and len(a) == 10


def test_real_output_through_workers(tmp_path):
    packer = pytest.importorskip("packer_cli")
    src = tmp_path / "in.jsonl"
    g = torch.Generator().manual_seed(0)
    lines = [torch.randint(1, 999, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist() for _ in range(120)]
    src.write_text("".join('{"input_ids": %s}\n' % x for x in lines))
    spec = packer.PackSpec(pack_size=96, cp=2, pad_to_max_length=True, pad_cu_seqlens=True)
    packer.pack([str(src)], str(tmp_path / "out"), spec)
    ds = PackedDataset(tmp_path / "out")
    static = ds.metadata["static"]
    loader = THDLoader(ds, cp_size=2, cp_rank=1, device="cpu", num_workers=2, seed=0)
    seen = []
    for b in loader:
        assert b.tokens.shape == (1, 48) and b.cu_seqlens.shape == (static["cu_seqlens_len"],)
        assert b.max_seqlen == static["max_seqlen"]
        seen += b.source_index.tolist()
    assert sorted(seen) == list(range(120))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_device_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="device='cpu'"):
        THDLoader(_dataset(), device="cuda")


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_cuda_loader_never_syncs(num_workers):
    ds = _dataset(num_packs=12, pad_to_max_length=True)
    cpu = list(THDLoader(ds, cp_size=2, cp_rank=1, device="cpu", num_workers=0, seed=2))
    loader = THDLoader(ds, cp_size=2, cp_rank=1, device="cuda", num_workers=num_workers, pin_memory=True, seed=2)
    torch.zeros(1, device="cuda")  # initialise CUDA before watching for syncs
    torch.cuda.synchronize()
    got, acc = [], torch.zeros((), dtype=torch.int64, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for b in loader:
            acc += b.tokens.sum() + b.cu_seqlens_padded.sum()  # some GPU work per step
            assert b.tokens.is_cuda and b.cu_seqlens.is_cuda and type(b.max_seqlen) is int
            params = b.packed_seq_params()
            assert type(params.max_seqlen_q) is int
            got.append(b)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert len(got) == len(cpu)
    for g, c in zip(got, cpu):
        assert torch.equal(g.tokens.cpu(), c.tokens) and torch.equal(g.cu_seqlens_padded.cpu(), c.cu_seqlens_padded)
    assert int(acc) == sum(int(c.tokens.sum() + c.cu_seqlens_padded.sum()) for c in cpu)


@pytest.fixture
def stand_in_cuda(monkeypatch):
    """The side-stream protocol's CUDA calls, logged by stand-ins (runs without a GPU)."""
    from packer_cli.torch import prefetch

    log = []

    class FakeStream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name} waits {other.name}")

    copy, compute = FakeStream("copy"), FakeStream("compute")

    class Ctx:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            log.append(f"enter {self.stream.name}")

        def __exit__(self, *exc):
            log.append(f"exit {self.stream.name}")

    class FakeBatch:
        def __init__(self, k, on_gpu=False):
            self.k, self.on_gpu = k, on_gpu

        def to(self, device, non_blocking):
            assert non_blocking
            log.append(f"copy {self.k}")
            return FakeBatch(self.k, on_gpu=True)

        def record_stream(self, stream):
            log.append(f"record {self.k} on {stream.name}")

    monkeypatch.setattr(prefetch.torch.cuda, "Stream", lambda device=None: copy)
    monkeypatch.setattr(prefetch.torch.cuda, "stream", Ctx)
    monkeypatch.setattr(prefetch.torch.cuda, "current_stream", lambda device=None: compute)
    return prefetch.cuda_prefetch, FakeBatch, log


def test_prefetch_order_of_operations(stand_in_cuda):
    cuda_prefetch, FakeBatch, log = stand_in_cuda
    for b in cuda_prefetch([FakeBatch(0), FakeBatch(1)], torch.device("cuda")):
        assert b.on_gpu
        log.append(f"step {b.k}")
    assert log == [
        "enter copy", "copy 0", "exit copy",
        "compute waits copy", "record 0 on compute",
        "enter copy", "copy 1", "exit copy",  # next copy issued before step 0 runs
        "step 0",
        "compute waits copy", "record 1 on compute",
        "step 1",
    ]  # fmt: skip


@pytest.mark.parametrize("error", [DataError("pack 2 is damaged"),
                                   RuntimeError("DataLoader worker (pid 7) exited unexpectedly"),
                                   MemoryError("out of memory copying the next batch"), OSError(5, "Input/output error")],
                         ids=["damaged-pack", "worker", "memory", "io"])
def test_prefetch_serves_the_batch_before_the_next_ones_error(stand_in_cuda, error):
    # fetching batch k+1 happens before batch k is handed over; its error must wait, or a
    # loop that skips a damaged pack by its position never trains the good pack before it.
    # Not only packer's own errors: a worker's failure or a failed copy of batch k+1 also waits
    # until batch k has been served, as the CPU path raises it
    cuda_prefetch, FakeBatch, log = stand_in_cuda

    def source():
        yield FakeBatch(0)
        yield FakeBatch(1)
        raise error

    served = []
    with pytest.raises(type(error)) as raised:
        for b in cuda_prefetch(source(), torch.device("cuda")):
            served.append(b.k)
    assert raised.value is error
    assert served == [0, 1]


def test_a_damaged_pack_is_raised_at_its_own_position_and_skipped_alone(stand_in_cuda, monkeypatch):
    # the whole loader on the (stand-in) CUDA path: the error comes after the good packs
    # before it, like on the CPU, so advancing the position by one skips the damaged pack only
    rows = [make_row([[10 * k + 1, 10 * k + 2, 10 * k + 3]], multiple=4, source_index=[k]) for k in range(6)]
    rows[3].loss_mask = rows[3].loss_mask.copy()
    rows[3].loss_mask[0] = 7
    ds = PackedDataset(InMemoryReader(rows, make_meta(rows, pack_size=16, multiple=4, cp=2)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(THDBatch, "to", lambda self, device, non_blocking=None: self)
    monkeypatch.setattr(THDBatch, "record_stream", lambda self, stream: None)

    def train(device):
        loader = THDLoader(ds, device=device, num_workers=0, pin_memory=False, shuffle=False)
        served = []
        while True:
            try:
                for b in loader:
                    served.append(b.source_index.item())
                return served
            except DataError:
                state = loader.state_dict()
                assert state["position"] == 3
                loader.load_state_dict({**state, "position": state["position"] + 1})

    assert train("cpu") == train("cuda") == [0, 1, 2, 4, 5]

    def stand_in(device):  # the same loop left to the loader: pack 2 stands in for pack 3
        loader = THDLoader(ds, device=device, num_workers=0, pin_memory=False, shuffle=False, on_damaged="lossless")
        with pytest.warns(UserWarning, match="lossless stand-in"):
            return [(b.source_index.item(), b.num_loss_tokens) for b in loader]

    assert stand_in("cpu") == stand_in("cuda") == [(0, 2), (1, 2), (2, 2), (2, 0), (4, 2), (5, 2)]


def _damaged_dataset(num_packs: int, damaged: set[int]) -> PackedDataset:
    rows = [make_row([[10 * k + 1, 10 * k + 2, 10 * k + 3]], multiple=4, source_index=[k]) for k in range(num_packs)]
    for k in damaged:
        rows[k].loss_mask = rows[k].loss_mask.copy()
        rows[k].loss_mask[0] = 7
    return PackedDataset(InMemoryReader(rows, make_meta(rows, pack_size=16, multiple=4, cp=2)))


@pytest.mark.parametrize("workers, damaged", [  # a rank's first, middle and last micro-batches
    (0, {0}), (0, {4}), (0, {9}), (0, {0, 3}), (0, {3, 6, 9}), (2, {0, 3}), (2, {9})])
def test_lossless_stand_ins_keep_data_parallel_ranks_in_step(workers, damaged):
    """Only the rank holding a damaged pack sees it; with on_damaged="lossless" it steps on a
    lossless stand-in (its previous micro-batch, or for its first the next one), so every rank
    takes len(loader) steps and every good pack is served once, losses and all."""
    ds = _damaged_dataset(12, damaged)
    served = []
    for rank in range(3):
        loader = THDLoader(ds, dp_size=3, dp_rank=rank, device="cpu", num_workers=workers, shuffle=False,
                           on_damaged="lossless")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            steps = [(b.source_index.tolist(), b.num_loss_tokens, int(b.loss_mask.sum())) for b in loader]
        mine = set(range(rank, 12, 3))
        assert len(steps) == len(loader) == 4 and loader.epoch == 1  # the pass ended; the next epoch is next
        trained = [index[0] for index, count, mask in steps if count]
        assert trained == sorted(mine - damaged)  # every good pack once, in order
        assert all(count == mask for _, count, mask in steps)  # a stand-in's count says what its mask holds
        stood_in = [index[0] for index, count, _ in steps if not count]
        assert len(stood_in) == len(mine & damaged) and not set(stood_in) & damaged
        said = [str(w.message) for w in caught if "lossless stand-in" in str(w.message)]
        assert len(said) == len(mine & damaged) and all("\n" not in m for m in said)
        served += trained
    assert sorted(served) == sorted(set(range(12)) - damaged)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_worker_s_error_is_the_one_line_error_of_the_main_process(workers):
    """Raised in a worker, torch re-raised the DataError with its own first line ("Caught
    DataError in DataLoader worker process 1.") and the worker's traceback in the message: the
    lossless warning named no pack, and the raised error ran to 20 lines. Both are now what
    ``num_workers=0`` gives."""
    ds = _damaged_dataset(6, {3})

    def raised(num_workers):
        with pytest.raises(DataError) as info:
            list(THDLoader(ds, device="cpu", num_workers=num_workers, shuffle=False))
        return str(info.value)

    def warned(num_workers):
        loader = THDLoader(ds, device="cpu", num_workers=num_workers, shuffle=False, on_damaged="lossless")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            steps = [b.source_index.item() for b in loader]
        return steps, [str(w.message) for w in caught if "lossless stand-in" in str(w.message)]

    message = raised(0)
    assert "\n" not in message and "pack 3" in message, message
    assert raised(workers) == message
    steps, said = warned(0)
    assert steps == [0, 1, 2, 2, 4, 5] and len(said) == 1 and message in said[0], said
    assert warned(workers) == (steps, said)


def test_the_readme_skip_recipe_stays_in_its_epoch_when_the_last_micro_batch_is_damaged():
    """Loading the state one further (past a damaged last micro-batch) and iterating again
    started the next epoch within this one; docs/LOADER.md's set_epoch after it keeps the epoch."""
    ds = _damaged_dataset(6, {5})
    loader = THDLoader(ds, device="cpu", num_workers=0, shuffle=False)
    served = []
    while True:
        try:
            for batch in loader:
                served.append(batch.source_index.item())
            break
        except DataError:
            state = loader.state_dict()
            loader.load_state_dict({**state, "position": state["position"] + 1})
            loader.set_epoch(state["epoch"])
    assert served == [0, 1, 2, 3, 4]


def _lossless_steps(loader) -> list[tuple[int, int]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [(b.source_index.item(), b.num_loss_tokens) for b in loader]


@pytest.mark.parametrize("damaged", [{0}, {0, 1}, {2, 3}, {5}, {1, 4, 5}, {0, 1, 2, 3, 4}])
def test_a_resumed_pass_serves_the_same_stand_ins_and_steps(damaged):
    """The position counts steps served (stand-ins too), and a stand-in is the last good
    micro-batch before the damaged one, built again after a resume: resumed at any step, the
    rest of the pass is what the uninterrupted pass served. (A state saved between two owed
    stand-ins had skipped a step; a resume had no previous batch, so it stood in with the next
    one, or raised before a damaged last micro-batch.)"""
    ds = _damaged_dataset(6, damaged)
    whole = _lossless_steps(THDLoader(ds, device="cpu", num_workers=0, shuffle=False, on_damaged="lossless"))
    assert len(whole) == 6
    for step in range(7):
        loader = THDLoader(ds, device="cpu", num_workers=0, shuffle=False, on_damaged="lossless")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            served = [(b.source_index.item(), b.num_loss_tokens) for b in itertools.islice(loader, step)]
        state = loader.state_dict()
        assert state["position"] == len(served) == min(step, 6)
        resumed = THDLoader(ds, device="cpu", num_workers=0, shuffle=False, on_damaged="lossless")
        resumed.load_state_dict(state)
        resumed.set_epoch(0)
        assert served + _lossless_steps(resumed) == whole, step


def test_a_pass_with_no_good_micro_batch_raises_even_with_stand_ins():
    ds = _damaged_dataset(3, {0, 1, 2})
    loader = THDLoader(ds, device="cpu", num_workers=0, shuffle=False, on_damaged="lossless")
    with pytest.warns(UserWarning, match="lossless stand-in"), \
            pytest.raises(DataError, match="no good micro-batch in this pass to stand in for it"):
        list(loader)


def test_on_damaged_is_checked():
    with pytest.raises(ValueError, match="on_damaged must be one of 'raise', 'lossless', got 'skip'"):
        THDLoader(_damaged_dataset(3, set()), device="cpu", on_damaged="skip")


def test_a_lossless_batch_keeps_everything_but_the_loss():
    batch = THDBatch.from_row(make_row([[1, 2, 3], [4, 5]], multiple=4), make_meta([], pack_size=16, multiple=4))
    lossless = batch.without_loss()
    assert batch.num_loss_tokens > 0 and batch.loss_mask.sum() > 0  # the batch itself is untouched
    assert lossless.num_loss_tokens == 0 and lossless.loss_mask.shape == batch.loss_mask.shape
    assert not lossless.loss_mask.any() and lossless.loss_mask.dtype == batch.loss_mask.dtype
    assert (lossless.hf_kwargs()["labels"] == -100).all()
    for name in ("tokens", "labels", "position_ids", "cu_seqlens", "cu_seqlens_padded"):
        assert getattr(lossless, name) is getattr(batch, name)
    assert lossless.max_seqlen == batch.max_seqlen and lossless.num_real_tokens == batch.num_real_tokens


@pytest.mark.parametrize("device", ["meta", "mps", "xpu"])
def test_a_device_other_than_cpu_or_cuda_is_refused(device):
    # the batches would otherwise stay on the CPU without a word
    with pytest.raises(ValueError, match="served on 'cpu' or 'cuda'"):
        THDLoader(_dataset(), device=device)


def test_a_loader_with_empty_epochs_says_so():
    ds = _dataset(num_packs=10)
    with pytest.warns(UserWarning, match="10 packs make no micro-batch of 1 pack for each of 16 DP ranks; every"):
        loader = THDLoader(ds, dp_size=16, dp_rank=3, device="cpu", num_workers=0)
    assert len(loader) == 0 and list(loader) == []
    with pytest.warns(UserWarning, match="THDLoader: 1 pack makes no micro-batch of 2 packs for each of 1 DP rank;"):
        THDLoader(_dataset(num_packs=1), batch_packs=2, device="cpu", num_workers=0)


def test_a_pass_that_took_the_whole_epoch_without_ending_continues_with_the_next():
    """islice/zip over the loader, or a break after the last step, took every micro-batch of
    an epoch without exhausting the iterator; the next pass was empty (and so was a resume
    from a checkpoint taken at that step)."""
    import itertools

    ds = _dataset(num_packs=10)
    ref = THDLoader(ds, seed=3, device="cpu", num_workers=0)
    epochs = [_ids(ref) for _ in range(3)]
    loader = THDLoader(ds, seed=3, device="cpu", num_workers=0)
    passes = [_ids(itertools.islice(loader, len(loader))) for _ in range(3)]
    assert passes == epochs
    state = THDLoader(ds, seed=3, device="cpu", num_workers=0)
    list(itertools.islice(state, len(state)))
    assert state.state_dict()["position"] == len(state)
    resumed = THDLoader(ds, seed=3, device="cpu", num_workers=0)
    resumed.load_state_dict(state.state_dict())
    assert _ids(resumed) == epochs[1]
    # docs/LOADER.md's loop calls set_epoch(e) after restoring: epoch e is finished, nothing is replayed.
    looped = THDLoader(ds, seed=3, device="cpu", num_workers=0)
    looped.load_state_dict(state.state_dict())
    served = []
    for epoch in (0, 1, 2):
        looped.set_epoch(epoch)
        served.append(_ids(looped))
    assert served == [[], epochs[1], epochs[2]]
    # A set_epoch() before the state is loaded is replaced by it, as a later one would be: it made
    # the next pass the empty rest of epoch 0 (the same packs in the end, one pass later).
    early = THDLoader(ds, seed=3, device="cpu", num_workers=0)
    early.set_epoch(0)
    early.load_state_dict(state.state_dict())
    assert _ids(early) == epochs[1]


@pytest.mark.parametrize("kwargs", [dict(seed=-1), dict(seed=1.5), dict(seed=None), dict(seed=True), dict(seed="5"),
                                    dict(cp_size=2, cp_rank=1.0), dict(cp_size=2, cp_rank=True),
                                    dict(cp_size=2.0, cp_rank=0)])
def test_seed_and_cp_arguments_are_checked_when_the_loader_is_built(kwargs):
    """They failed at the first batch, inside a worker, or not at all (True, '5')."""
    with pytest.raises(ValueError, match="seed must be an integer >= 0|cp_size must be an integer >= 1 and cp_rank one of 0..cp_size-1"):
        THDLoader(_dataset(num_packs=10), device="cpu", num_workers=0, **kwargs)


def test_a_numpy_seed_is_stored_as_an_int_and_large_seeds_do_not_collide():
    loader = THDLoader(_dataset(num_packs=10), seed=np.int64(1234), device="cpu", num_workers=0)
    assert type(loader.state_dict()["seed"]) is int  # a checkpoint loads with torch.load(weights_only=True)
    orders = {}
    for seed, epoch in [(5, 1), (5 + 2**32, 0), (7, 3), (7 + 3 * 2**32, 0), (2**70, 0), (2**70, 1)]:
        sampler = MicroBatchSampler(200, seed=seed)
        orders[seed, epoch] = tuple(np.concatenate(sampler.epoch_order(epoch)).tolist())
    assert len(set(orders.values())) == len(orders)
    assert orders[5, 1] == tuple(np.random.default_rng([5, 1]).permutation(200).tolist())  # unchanged below 2**32


def test_unshuffled_packs_that_are_never_served_are_named():
    ds = _dataset(num_packs=26)
    with pytest.warns(UserWarning, match=r"shuffle=False\): the last 8 packs of 26 make no whole micro-batch for every DP rank and are never served"):
        THDLoader(ds, shuffle=False, batch_packs=3, dp_size=3, cp_size=1, device="cpu", num_workers=0)


def test_a_state_saved_on_another_output_is_refused(tmp_path):
    """The same number of packs from another run (another seed) resumed without a word, serving
    some samples twice and others never; a state without the output's fingerprint still loads."""
    packer = pytest.importorskip("packer_cli")
    src = tmp_path / "in.jsonl"
    g = torch.Generator().manual_seed(1)
    lines = [torch.randint(1, 999, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
             for _ in range(200)]
    src.write_text("".join('{"input_ids": %s}\n' % x for x in lines))
    packer.pack([str(src)], str(tmp_path / "a"), packer.PackSpec(pack_size=128, seed=1))
    packer.pack([str(src)], str(tmp_path / "b"), packer.PackSpec(pack_size=128, seed=2))
    a, b = PackedDataset(tmp_path / "a"), PackedDataset(tmp_path / "b")
    assert len(a) == len(b)
    saved = THDLoader(a, device="cpu", num_workers=0)
    next(iter(saved))
    state = saved.state_dict()
    assert type(state["output"]) is str and state["output"] == THDLoader(PackedDataset(tmp_path / "a"),
                                                                          device="cpu").state_dict()["output"]
    with pytest.raises(ValueError, match="loader state was saved reading another output"):
        THDLoader(b, device="cpu", num_workers=0).load_state_dict(state)
    THDLoader(a, device="cpu", num_workers=0).load_state_dict(state)
    older = {k: v for k, v in state.items() if k != "output"}
    THDLoader(b, device="cpu", num_workers=0).load_state_dict(older)
    # the same input staged elsewhere and packed again: the same files, so the same packs
    staged = tmp_path / "job" / "in.jsonl"
    staged.parent.mkdir()
    staged.write_bytes(src.read_bytes())
    packer.pack([str(staged)], str(tmp_path / "c"), packer.PackSpec(pack_size=128, seed=1))
    THDLoader(PackedDataset(tmp_path / "c"), device="cpu", num_workers=0).load_state_dict(state)


@pytest.mark.parametrize("kwargs", [dict(shuffle="false"), dict(shuffle=None), dict(shuffle=1),
                                    dict(pin_memory="no"), dict(batch_packs="2", cp_size=1),
                                    dict(sequence_parallel="yes"), dict(tp_size=0), dict(tp_size=2.0),
                                    dict(num_workers=-1), dict(num_workers=2, prefetch_factor=0),
                                    dict(num_workers=2, prefetch_factor=1.5)])
def test_flags_and_counts_of_the_loader_are_checked(kwargs):
    """shuffle='false' shuffled; batch_packs='2' was a bare TypeError from a comparison;
    prefetch_factor=0 was taken, and torch refused it at the first batch, from its iterator."""
    with pytest.raises(ValueError, match="must be True or False|bad sharding|must be an integer >= [01]"):
        THDLoader(_dataset(num_packs=10), device="cpu", **{"num_workers": 0, **kwargs})


def test_a_numpy_flag_is_stored_as_a_bool():
    loader = THDLoader(_dataset(num_packs=10), shuffle=np.bool_(False), device="cpu", num_workers=0)
    assert type(loader.state_dict()["shuffle"]) is bool  # a checkpoint loads with torch.load(weights_only=True)
    with pytest.raises(ValueError, match="static must be True, False or None, got 'false'"):
        PackedDataset(_dataset(num_packs=4).reader, static="false")


def test_a_single_unshuffled_pack_that_is_never_served_is_named():
    ds = _dataset(num_packs=11)
    with pytest.warns(UserWarning, match=r"shuffle=False\): the last pack of 11 makes no whole micro-batch for every DP rank and is never served"):
        loader = THDLoader(ds, shuffle=False, dp_size=2, dp_rank=1, device="cpu", num_workers=0)
    assert len(loader) == 5


def test_sampler_len_is_what_a_resumed_pass_yields():
    """len() of a sampler started mid-epoch (start = micro-batches already consumed) counts the
    micro-batches it still yields, the tail of the same order."""
    s = MicroBatchSampler(23, batch_packs=2, dp_size=3, dp_rank=1, seed=5)
    full = list(s)
    for start in range(len(full) + 1):
        s.start = start
        assert len(s) == len(list(s)) == len(full) - start and list(s) == full[start:]


def test_epoch_order_is_that_of_the_epoch_asked_for():
    """epoch_order(e) is epoch e's shard whatever epoch the sampler is at (the loader asks for
    the current one; callers checking another epoch's order got the current one's)."""
    s = MicroBatchSampler(40, batch_packs=2, dp_size=2, dp_rank=1, seed=9)
    passes = []
    for epoch in range(3):
        s.epoch = epoch
        passes.append(list(s))
    s.epoch = 7
    assert [s.epoch_order(e).tolist() for e in range(3)] == passes and passes[0] != passes[1]
