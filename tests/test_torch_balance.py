"""Balancing each step's packs over the data-parallel ranks (``THDLoader(balance=...)``); the kernel
itself is tested in test_plan_balance.py, without torch."""
import re
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import packer_cli as packer  # noqa: E402
from packer_cli.shards.bridge_output import BridgeOutput  # noqa: E402
from packer_cli.torch import PackedDataset, THDLoader, flops_cost, training_flops  # noqa: E402
from packer_cli.torch.sampler import MicroBatchSampler  # noqa: E402
from packer_cli.torch.testing import InMemoryReader, make_meta, make_row  # noqa: E402

LLAMA_8B = dict(num_layers=32, hidden_size=4096, num_heads=32, head_dim=128, ffn_hidden_size=14336,
                num_query_groups=8, vocab_size=128256)


@pytest.fixture(scope="module")
def outputs(synthetic_parquet, tmp_path_factory):
    """The synthetic long-tailed samples packed at C = 2048, natively and in Bridge's layout."""
    tmp = tmp_path_factory.mktemp("balance")
    spec = packer.PackSpec(pack_size=2048)
    packer.pack([str(synthetic_parquet)], str(tmp / "native"), spec)
    packer.pack([str(synthetic_parquet)], str(tmp / "bridge"), spec, output=BridgeOutput())
    return {"native": str(tmp / "native"), "megatron-bridge": str(tmp / "bridge")}


@pytest.mark.parametrize("layout", ["native", "megatron-bridge"])
def test_pack_statistics_are_what_each_pack_s_batch_reports(outputs, layout):
    ds = PackedDataset(outputs[layout])
    tokens, squares = ds.pack_statistics()
    assert tokens.dtype == squares.dtype == np.int64 and tokens.shape == squares.shape == (len(ds),)
    reported = [(ds[i].num_real_tokens, ds[i].seqlen_sq_sum) for i in range(len(ds))]
    assert list(zip(tokens.tolist(), squares.tolist())) == reported
    assert len(set(squares.tolist())) > len(ds) // 2  # packs of the same size, but not the same work


def test_pack_statistics_of_an_open_reader():
    rows = [make_row([[1] * 5, [2] * 3, [3] * 9], multiple=4), make_row([[4] * 16], multiple=4),
            make_row([[5] * 2, [6] * 3], multiple=4)]
    ds = PackedDataset(InMemoryReader(rows, make_meta(rows, pack_size=24, multiple=4)))
    tokens, squares = ds.pack_statistics()
    # a sample of n tokens is a sequence of n - 1 (its last token is only a label)
    assert tokens.tolist() == [14, 15, 3] and squares.tolist() == [16 + 4 + 64, 225, 1 + 4]
    assert [(ds[i].num_real_tokens, ds[i].seqlen_sq_sum) for i in range(3)] == list(zip(tokens, squares))


def _waits(orders, costs, per_step):
    """For each whole step, the costliest rank's share over the ranks' mean (1.0: no rank waits)."""
    loads = np.stack([costs[order].sum(axis=1) for order in orders], axis=1)  # [micro-batches, ranks]
    steps = loads.shape[0] // per_step
    loads = loads[:steps * per_step].reshape(steps, per_step, -1).sum(axis=1)  # [steps, ranks]
    return loads.max(axis=1) / loads.mean(axis=1)


@pytest.mark.parametrize("batch_packs, per_step", [(1, 4), (2, 3)])
def test_balanced_steps_hold_the_same_packs_and_wait_less(outputs, batch_packs, per_step):
    ds = PackedDataset(outputs["native"])
    squares = ds.pack_statistics()[1].astype(np.float64)
    dp = 4

    def orders(balance, epoch):
        return [THDLoader(ds, dp_size=dp, dp_rank=r, batch_packs=batch_packs, seed=5, device="cpu", num_workers=0,
                          balance=balance, micro_batches_per_step=per_step).sampler.epoch_order(epoch)
                for r in range(dp)]

    for epoch in (0, 1):
        dealt, balanced = orders(None, epoch), orders("attention", epoch)
        assert all(o.shape == dealt[0].shape for o in balanced)
        # every step holds the packs it held unbalanced, each rank the same number of them
        for first in range(0, len(dealt[0]), per_step):
            now = [o[first:first + per_step].ravel().tolist() for o in balanced]
            before = [o[first:first + per_step].ravel().tolist() for o in dealt]
            assert sorted(sum(now, [])) == sorted(sum(before, []))
            assert [len(x) for x in now] == [len(x) for x in before]
        # the slowest rank of a step waits for less: max over mean of the ranks' attention work
        ratio = {"dealt": _waits(dealt, squares, per_step), "balanced": _waits(balanced, squares, per_step)}
        assert (ratio["balanced"] <= ratio["dealt"] + 1e-12).all()
        assert ratio["balanced"].mean() < 1.15 < ratio["dealt"].mean()
    assert not all((a == b).all() for a, b in zip(orders("attention", 0), orders("attention", 1)))


def test_the_loader_serves_the_balanced_order_and_resumes_it_exactly(outputs):
    ds = PackedDataset(outputs["native"])
    tokens, squares = ds.pack_statistics()

    def loader(**kwargs):
        return THDLoader(ds, dp_size=3, dp_rank=1, seed=2, device="cpu", num_workers=0, **kwargs)

    balanced = loader(balance="attention", micro_batches_per_step=4)
    served = [b.seqlen_sq_sum for b in balanced]
    assert served == squares[balanced.sampler.epoch_order(0)[:, 0]].tolist()
    assert served != [b.seqlen_sq_sum for b in loader()]

    first = loader(balance="attention", micro_batches_per_step=4)
    it = iter(first)
    head = [next(it).seqlen_sq_sum for _ in range(7)]
    state = first.state_dict()
    assert state["balance"]["micro_batches_per_step"] == 4
    resumed = loader(balance="attention", micro_batches_per_step=4)
    resumed.load_state_dict(state)
    resumed.set_epoch(state["epoch"])
    assert head + [b.seqlen_sq_sum for b in resumed] == served

    for other in (loader(), loader(balance="tokens", micro_batches_per_step=4),
                  loader(balance="attention", micro_batches_per_step=2)):
        with pytest.raises(ValueError, match="loader state has balance="):
            other.load_state_dict(state)
    with pytest.raises(ValueError, match="loader state has balance=None"):
        first.load_state_dict(loader().state_dict())


def test_flops_cost_is_training_flops_of_each_pack(outputs):
    cost = flops_cost(**LLAMA_8B)
    tokens, squares = PackedDataset(outputs["native"]).pack_statistics()
    costs = cost(tokens, squares)
    for i in (0, 7, len(tokens) - 1):
        assert costs[i] == pytest.approx(training_flops(int(tokens[i]), int(squares[i]), **LLAMA_8B), rel=1e-12)
    loader = THDLoader(PackedDataset(outputs["native"]), dp_size=2, seed=1, device="cpu", num_workers=0,
                       balance=cost, micro_batches_per_step=2)
    assert loader.sampler.costs.tolist() == costs.tolist()


@pytest.mark.parametrize("kwargs, says", [
    (dict(dp_size=1, micro_batches_per_step=4), "one DP rank has no other"),
    (dict(dp_size=2), "each rank takes one pack a step"),
])
def test_balancing_that_cannot_help_warns(outputs, kwargs, says):
    ds = PackedDataset(outputs["native"])
    with pytest.warns(UserWarning, match=says):
        THDLoader(ds, device="cpu", num_workers=0, balance="attention", **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        THDLoader(ds, device="cpu", num_workers=0, dp_size=2, balance="attention", batch_packs=2)


@pytest.mark.parametrize("balance, says", [
    ("flops", "balance must be None, 'tokens', 'attention' or a callable"),
    (3, "balance must be None"),
    (lambda tokens, squares: squares[:-1], "costs must be .* numbers, one a pack"),
    (lambda tokens, squares: -tokens, "pack 0 costs -"),
    (lambda tokens, squares: squares * np.nan, "pack 0 costs nan"),
    (lambda tokens, squares: tokens.astype(str), "costs must be"),
])
def test_bad_balance_arguments_are_refused(outputs, balance, says):
    with pytest.raises(ValueError, match=says):
        THDLoader(PackedDataset(outputs["native"]), dp_size=2, device="cpu", num_workers=0, balance=balance,
                  micro_batches_per_step=2)


@pytest.mark.parametrize("steps", [0, -1, 1.5, True])
def test_micro_batches_per_step_is_a_count(steps):
    with pytest.raises(ValueError, match="micro_batches_per_step must be an integer >= 1"):
        MicroBatchSampler(10, dp_size=2, costs=np.ones(10), micro_batches_per_step=steps)


@pytest.mark.parametrize("num_packs, dp, per_step, whole_steps", [(28, 2, 3, 4), (7, 1, 3, 2), (9, 3, 2, 1)])
def test_an_epoch_s_shorter_last_step_is_balanced_over_its_rounds(num_packs, dp, per_step, whole_steps):
    # e.g. 28 packs, 2 ranks, 3 micro-batches a step: 14 micro-batches each, four whole steps and one of 2
    costs = np.arange(num_packs, dtype=np.float64) % 5
    samplers = [MicroBatchSampler(num_packs, dp_size=dp, dp_rank=r, costs=costs, micro_batches_per_step=per_step,
                                  seed=4) for r in range(dp)]
    orders = [s.epoch_order(0) for s in samplers]
    per_rank = num_packs // dp
    assert all(o.shape == (per_rank, 1) for o in orders)
    assert sorted(np.concatenate(orders).ravel().tolist()) == list(range(num_packs))
    permutation = np.random.default_rng([4, 0]).permutation(num_packs)
    step = dp * per_step
    for first in range(0, num_packs, step):
        mine = [set(o.ravel()[first // dp:(first + step) // dp].tolist()) for o in orders]
        assert set().union(*mine) == set(permutation[first:first + step].tolist())
    assert num_packs // step == whole_steps and num_packs % step


def test_a_balanced_sampler_s_epochs_are_each_their_own():
    costs = np.random.default_rng(3).random(40)
    sampler = MicroBatchSampler(40, dp_size=2, dp_rank=1, costs=costs, micro_batches_per_step=4, seed=9)
    for epoch in (0, 1, 0, 2):
        fresh = MicroBatchSampler(40, dp_size=2, dp_rank=1, costs=costs, micro_batches_per_step=4, seed=9)
        assert sampler.epoch_order(epoch).tolist() == fresh.epoch_order(epoch).tolist()
    assert sampler.epoch_order(1).tolist() != sampler.epoch_order(2).tolist()


def test_shared_data_steps_balanced_by_attention(shared_files, tmp_path):
    """The real SFT samples at C = 1024: dealt at random, the slowest of 8 ranks does 28 % more
    attention work in a step of 4 micro-batches than the mean; balanced, 3 %."""
    packer.pack([str(p) for p in shared_files], str(tmp_path / "out"), packer.PackSpec(pack_size=1024))
    ds = PackedDataset(tmp_path / "out")
    squares = ds.pack_statistics()[1].astype(np.float64)
    ratios = {}
    for balance in (None, "attention"):
        orders = [THDLoader(ds, dp_size=8, dp_rank=r, seed=0, device="cpu", num_workers=0, balance=balance,
                            micro_batches_per_step=4).sampler.epoch_order(0) for r in range(8)]
        ratios[balance] = float(_waits(orders, squares, 4).mean())
    assert ratios["attention"] < 1.05 < 1.2 < ratios[None]  # 1.033 and 1.283


def test_pack_statistics_of_an_output_changed_after_opening(synthetic_parquet, tmp_path):
    out = tmp_path / "out"
    packer.pack([str(synthetic_parquet)], str(out), packer.PackSpec(pack_size=2048, seed=1))
    ds = PackedDataset(out)
    served = [ds[i].seqlen_sq_sum for i in range(len(ds))]
    # the same packs in another order: as many packs, other statistics at each index
    packer.pack([str(synthetic_parquet)], str(out), packer.PackSpec(pack_size=2048, seed=2), overwrite=True)
    assert len(PackedDataset(out)) == len(ds) and [ds[i].seqlen_sq_sum for i in range(len(ds))] == served
    with pytest.raises(packer.DataError, match=f"^{out}: the output changed after the dataset was opened"):
        ds.pack_statistics()
    with pytest.raises(packer.DataError, match="the output changed after the dataset was opened"):
        THDLoader(ds, dp_size=2, device="cpu", num_workers=0, balance="attention", micro_batches_per_step=2)
    ds = PackedDataset(out)
    shard = next(out.glob("*.arrow"))
    shard.write_bytes(b"\0" * shard.stat().st_size)
    with pytest.raises(packer.DataError,
                       match=f"^{out}: {shard.name}: cannot open as Arrow IPC .*; run `packer verify`"):
        ds.pack_statistics()


@pytest.mark.parametrize("make", [
    lambda tokens, squares: torch.tensor(squares, dtype=torch.bfloat16, requires_grad=True),
    lambda tokens, squares: torch.tensor(squares, dtype=torch.float64),
])
def test_costs_as_torch_tensors(outputs, make):
    ds = PackedDataset(outputs["native"])
    loader = THDLoader(ds, dp_size=2, device="cpu", num_workers=0, balance=make, micro_batches_per_step=2)
    expected = make(*ds.pack_statistics()).detach().double().numpy()
    assert loader.sampler.costs.tolist() == expected.tolist()


def test_costs_that_are_not_numbers_are_one_line_errors(outputs):
    with pytest.raises(ValueError, match=r"^THDLoader\(balance=.*\): costs must be \d+ numbers, one a pack: "):
        THDLoader(PackedDataset(outputs["native"]), dp_size=2, device="cpu", num_workers=0,
                  balance=lambda tokens, squares: [[1.0], [1.0, 2.0]] * (len(tokens) // 2), micro_batches_per_step=2)


@pytest.mark.filterwarnings(r"ignore:THDLoader\(shuffle=False\)")  # packs left over, as the test expects
@pytest.mark.parametrize("batch_packs, per_step", [(1, 1), (1, 3), (2, 2)])
def test_epoch_scope_makes_each_step_of_packs_of_about_the_same_cost(outputs, batch_packs, per_step):
    ds = PackedDataset(outputs["native"])
    squares = ds.pack_statistics()[1].astype(np.float64)
    dp = 4
    step_packs = dp * per_step * batch_packs

    def orders(epoch, scope, balance="attention", shuffle=True):
        return [THDLoader(ds, dp_size=dp, dp_rank=r, batch_packs=batch_packs, seed=5, device="cpu", num_workers=0,
                          shuffle=shuffle, balance=balance, micro_batches_per_step=per_step,
                          balance_scope=scope).sampler.epoch_order(epoch) for r in range(dp)]

    grouped, dealt = orders(0, "epoch"), orders(0, "step", None)
    served = np.concatenate([o.ravel() for o in grouped])
    assert sorted(served.tolist()) == sorted(np.concatenate([o.ravel() for o in dealt]).tolist())
    # the whole steps do not interleave in cost: each is a run of the epoch's packs by decreasing cost
    per_micro = len(grouped[0])
    steps = [squares[np.concatenate([o[first:first + per_step].ravel() for o in grouped])]
             for first in range(0, per_micro - per_micro % per_step, per_step)]
    assert all(step.size == step_packs for step in steps)
    by_cost = sorted(steps, key=lambda step: (-step.max(), -step.min()))  # equal costs may straddle two steps
    assert all(costlier.min() >= cheaper.max() for costlier, cheaper in zip(by_cost, by_cost[1:]))
    assert [step.max() for step in steps] != [step.max() for step in by_cost]  # served in a seeded order
    def step_maxima(rank_orders):  # what tells the steps' order apart, whatever the ties inside
        return [float(squares[np.concatenate([o[f:f + per_step].ravel() for o in rank_orders])].max())
                for f in range(0, per_micro - per_micro % per_step, per_step)]

    assert step_maxima(orders(1, "epoch")) != step_maxima(grouped)  # each epoch serves its steps in its own order
    firsts = step_maxima(orders(0, "epoch", shuffle=False))
    assert firsts == sorted(firsts, reverse=True)
    # so even one pack a rank a step is balanced
    ratio = {name: float(_waits(got, squares, per_step).mean())
             for name, got in (("dealt", dealt), ("grouped", grouped))}
    assert ratio["grouped"] < 1.03 < 1.3 < ratio["dealt"]


def test_epoch_scope_resumes_exactly_and_is_part_of_the_state(outputs):
    ds = PackedDataset(outputs["native"])

    def loader(**kwargs):
        return THDLoader(ds, dp_size=2, dp_rank=1, seed=8, device="cpu", num_workers=0, balance="attention",
                         **kwargs)

    served = [b.seqlen_sq_sum for b in loader(balance_scope="epoch")]
    first = loader(balance_scope="epoch")
    it = iter(first)
    head = [next(it).seqlen_sq_sum for _ in range(5)]
    state = first.state_dict()
    assert state["balance"]["scope"] == "epoch"
    resumed = loader(balance_scope="epoch")
    resumed.load_state_dict(state)
    resumed.set_epoch(state["epoch"])
    assert head + [b.seqlen_sq_sum for b in resumed] == served
    with pytest.raises(ValueError, match="loader state has balance="):
        loader(micro_batches_per_step=2).load_state_dict(state)


def test_balance_scope_arguments(outputs):
    ds = PackedDataset(outputs["native"])
    for scope, shown in (("global", "'global'"), (0, "0"), (-3, "-3"), (1.5, "1.5"), (True, "True")):
        with pytest.raises(ValueError, match=f"balance_scope must be 'step', 'epoch' or a number of steps >= 1, "
                                             f"got {re.escape(shown)}$"):
            THDLoader(ds, dp_size=2, device="cpu", num_workers=0, balance="attention", balance_scope=scope)
    with pytest.raises(ValueError, match=r"balance_scope='epoch' needs the packs' costs \(THDLoader's balance=\)"):
        THDLoader(ds, dp_size=2, device="cpu", num_workers=0, balance_scope="epoch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one pack a rank a step gains with this scope
        THDLoader(ds, dp_size=2, device="cpu", num_workers=0, balance="attention", balance_scope="epoch")
    with pytest.warns(UserWarning, match="one DP rank has no other"):
        THDLoader(ds, device="cpu", num_workers=0, balance="attention", balance_scope="epoch")


def test_a_window_of_steps_sorts_within_each_window_and_makes_new_steps_each_epoch(outputs):
    ds = PackedDataset(outputs["native"])
    squares = ds.pack_statistics()[1].astype(np.float64)
    dp, window = 4, 4
    n = len(ds) - len(ds) % dp

    def steps(scope, epoch):
        orders = [THDLoader(ds, dp_size=dp, dp_rank=r, seed=2, device="cpu", num_workers=0, balance="attention",
                            balance_scope=scope).sampler.epoch_order(epoch)[:, 0] for r in range(dp)]
        return [frozenset(int(o[i]) for o in orders) for i in range(len(orders[0]))]

    permutation = np.random.default_rng([2, 0]).permutation(len(ds))[:n]
    windows = [set(permutation[f:f + window * dp].tolist()) for f in range(0, n, window * dp)]
    for step in steps(window, 0):  # every step is made within one window of the permutation
        assert sum(step <= w for w in windows) == 1
    # the steps' make-up: about the same each epoch when the whole epoch is sorted, new with windows
    kept = {scope: len(set(steps(scope, 0)) & set(steps(scope, 1))) / len(steps(scope, 0))
            for scope in ("epoch", window)}
    assert kept[window] < 0.2 < 0.8 < kept["epoch"]

    def ratio(scope):
        orders = [THDLoader(ds, dp_size=dp, dp_rank=r, seed=2, device="cpu", num_workers=0,
                            balance=None if scope is None else "attention",
                            **({} if scope is None else {"balance_scope": scope})).sampler.epoch_order(0)
                  for r in range(dp)]
        return float(_waits(orders, squares, 1).mean())

    assert ratio("epoch") <= ratio(64) < 1.05 < ratio(window) < ratio(None)  # 1.010, 1.026, 1.247, 1.719


def test_a_window_given_as_a_numpy_integer_is_a_plain_int_in_the_state(outputs, tmp_path):
    loader = THDLoader(PackedDataset(outputs["native"]), dp_size=2, device="cpu", num_workers=0, balance="attention",
                       balance_scope=np.int64(4))
    torch.save(loader.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)  # what a checkpoint loads; NumPy scalars fail it
    assert type(state["balance"]["scope"]) is int and state["balance"]["scope"] == 4
    loader.load_state_dict(state)


@pytest.mark.parametrize("scope", ["step", "epoch", 3])
def test_too_few_packs_for_one_micro_batch_a_rank_make_an_empty_balanced_epoch(scope):
    sampler = MicroBatchSampler(5, dp_size=8, dp_rank=7, costs=np.ones(5), balance_scope=scope)
    assert sampler.epoch_order(0).shape == (0, 1) and list(sampler) == []
