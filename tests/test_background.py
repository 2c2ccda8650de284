"""background() and ordered_map(): order, errors at their turn, bounded work ahead, clean stops."""
from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import pytest

from packer_cli._background import background, ordered_map


def _slow_square(x: int) -> int:
    time.sleep(random.Random(x).random() * 0.004)  # finish out of order
    return x * x


@pytest.mark.parametrize("workers,ahead", [(1, 1), (2, 3), (4, 2)])
def test_ordered_map_keeps_order_under_random_delays(workers, ahead):
    assert list(ordered_map(_slow_square, range(60), workers=workers, ahead=ahead)) == [x * x for x in range(60)]


def test_ordered_map_raises_at_the_failing_items_turn():
    def fn(x):
        if x == 5:
            raise KeyError("item 5")
        return x

    seen = []
    with pytest.raises(KeyError, match="item 5"):
        for value in ordered_map(fn, range(20)):
            seen.append(value)
    assert seen == [0, 1, 2, 3, 4]


def test_ordered_map_never_runs_more_than_ahead_beyond_the_consumer():
    started, lock = [], threading.Lock()

    def fn(x):
        with lock:
            started.append(x)
        return x

    consumed = 0
    for value in ordered_map(fn, range(30), workers=4, ahead=3):
        time.sleep(0.002)
        with lock:
            assert max(started) <= value + 3  # at most `ahead` items past the one handed over
        consumed += 1
    assert consumed == 30


def test_stopping_early_cancels_what_has_not_started_and_joins():
    threads = threading.active_count()
    calls = []
    gen = ordered_map(lambda x: calls.append(x) or x, range(1000), workers=2, ahead=3)
    assert next(gen) == 0
    gen.close()
    assert len(calls) <= 5 and threading.active_count() == threads


def test_maps_sharing_a_pool_interleave_and_leave_it_running():
    with ThreadPoolExecutor(2) as pool:
        evens = ordered_map(_slow_square, range(0, 40, 2), ahead=2, pool=pool)
        odds = ordered_map(_slow_square, range(1, 40, 2), ahead=2, pool=pool)
        assert [v for pair in zip(evens, odds) for v in pair] == [x * x for x in range(40)]
        started = []
        stopped = ordered_map(lambda x: started.append(x) or x, range(100), ahead=2, pool=pool)
        with closing(stopped):
            assert next(stopped) == 0
        assert len(started) <= 3
        assert pool.submit(lambda: "still running").result() == "still running"


def test_background_yields_in_order_reraises_and_joins_on_early_stop():
    assert list(background(iter(range(50)), depth=1)) == list(range(50))

    def failing():
        yield 1
        raise ValueError("producer broke")

    got = []
    with pytest.raises(ValueError, match="producer broke"):
        for value in background(failing()):
            got.append(value)
    assert got == [1]

    threads = threading.active_count()
    produced = []

    def endless():
        for x in range(10**9):
            produced.append(x)
            yield x

    gen = background(endless(), depth=2)
    assert next(gen) == 0
    gen.close()
    assert threading.active_count() == threads and len(produced) <= 5


def test_a_producer_blocked_in_the_kernel_does_not_hold_the_consumer(monkeypatch):
    """A producer stuck where stop cannot reach it (a FIFO's open() with no writer, a hung
    mount): the consumer's error still unwinds, after ABANDON_AFTER_S, and the daemon thread
    ends on its own once unblocked."""
    import time

    from packer_cli import _background

    monkeypatch.setattr(_background, "ABANDON_AFTER_S", 0.2)
    release = threading.Event()

    def stuck():
        yield 1
        release.wait()  # blocked, not looking at the stop flag
        yield 2

    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="consumer failed"):
        for _ in background(stuck()):
            raise RuntimeError("consumer failed")
    assert time.perf_counter() - start < 5
    release.set()


def test_a_producer_raising_a_base_exception_hands_it_to_the_consumer():
    """SystemExit (or any BaseException) in the producer reaches the consumer; the consumer must
    not wait for an item that never comes."""
    def exiting():
        yield 1
        raise SystemExit(3)

    got = []
    runner = threading.Thread(target=lambda: got.append(_drain(background(exiting()))), daemon=True)
    runner.start()
    runner.join(10)
    assert not runner.is_alive(), "the consumer hung"
    assert got == [([1], SystemExit)]


def _drain(items):
    seen = []
    try:
        for item in items:
            seen.append(item)
    except BaseException as exc:  # noqa: BLE001 - the test looks at it
        return seen, type(exc)
    return seen, None


def test_closing_background_closes_the_producer_the_caller_still_holds():
    ran_finally = threading.Event()

    def producer():
        try:
            yield from range(100)
        finally:
            ran_finally.set()

    held = producer()
    with closing(background(held, depth=1)) as items:
        assert next(items) == 0
    assert ran_finally.wait(5), "the producer's finally did not run"


def test_stopping_a_map_on_a_shared_pool_waits_for_its_started_items():
    """The pipeline removes the spill the items read once the map is closed: an item still
    running then would read a file that is gone."""
    started, done = [], []

    def slow(x):
        started.append(x)
        time.sleep(0.3)
        done.append(x)
        return x

    with ThreadPoolExecutor(3) as pool:
        gen = ordered_map(slow, range(10), ahead=3, pool=pool)
        assert next(gen) == 0
        gen.close()
        assert {1, 2} <= set(done) and sorted(done) == sorted(started), "the started items are done when close() returns"


def test_stopping_a_map_with_its_own_pool_cancels_the_queued_items():
    calls = []

    def slow(x):
        calls.append(x)
        time.sleep(0.2)
        return x

    gen = ordered_map(slow, range(10), workers=1, ahead=4)
    assert next(gen) == 0
    gen.close()  # item 1 may have started on the one worker; 2.. are queued and never run
    assert calls in ([0], [0, 1]), calls
