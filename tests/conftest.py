"""Shared fixtures: synthetic SFT data the project generates itself, and ../shared/data when present."""
from __future__ import annotations

import shutil
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packer_cli.demo import demo_table

from packer_cli import pipeline
from packer_cli.sources import parquet_lists

#: The spill memory ``pack`` holds by default (256 MiB), before the fixture below sets it to 0.
DEFAULT_SPILL_MEMORY = pipeline.DEFAULT_SPILL_MEMORY
#: The page size (level entries) below which the Parquet decoder hands a file to pyarrow.
DEFAULT_TINY_PAGE_VALUES = parquet_lists.TINY_PAGE_VALUES


@pytest.fixture(autouse=True)
def spill_to_the_file(monkeypatch):
    """Every test's input is far smaller than the default spill memory, which would hold all of
    it: in-process runs spill to the file by default here, the path most of a large input's
    spill takes. Tests of the memory part ask for it, and tests of the default restore
    ``DEFAULT_SPILL_MEMORY`` (runs in a fresh process keep the real default)."""
    monkeypatch.setattr(pipeline, "DEFAULT_SPILL_MEMORY", 0)


@pytest.fixture(autouse=True)
def tiny_pages_decoded_by_packer(monkeypatch):
    """The test files' Parquet pages are tiny (many page boundaries in a few hundred rows), which
    in real files packer's decoder hands to pyarrow as faster (``TINY_PAGE_VALUES``): in-process
    reads here keep them, so the decoder's paths are what the tests exercise. Tests of the
    hand-over restore ``DEFAULT_TINY_PAGE_VALUES`` (runs in a fresh process keep it)."""
    monkeypatch.setattr(parquet_lists, "TINY_PAGE_VALUES", 0)


@pytest.fixture(autouse=True)
def stopping_signals_not_ignored():
    """A runner started in the background (SIGINT ignored) or under ``nohup`` (SIGHUP ignored)
    passes the ignored signals on to every child, which rightly keeps them ignored, as packer's
    CLI does: a test delivering one then saw nothing happen, and failed. Each test runs with them
    at their defaults, as from a terminal, and the runner's dispositions come back after it."""
    ignored = [s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) is signal.SIG_IGN]
    for signum in ignored:
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    yield
    for signum in ignored:
        signal.signal(signum, signal.SIG_IGN)


SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SHARED_FILES = sorted(SHARED_DATA.glob("*.parquet")) if SHARED_DATA.is_dir() else []


def require_shared():
    if not SHARED_FILES:
        pytest.skip(f"real SFT data not found at {SHARED_DATA} (only in the project's CI layout)")
    return SHARED_FILES


@pytest.fixture(scope="session")
def shared_files():
    return require_shared()


@pytest.fixture(scope="session")
def synthetic_parquet(tmp_path_factory) -> Path:
    """3,000 synthetic samples with a long tail (some longer than 2,048 tokens)."""
    path = tmp_path_factory.mktemp("synthetic") / "synthetic.parquet"
    pq.write_table(demo_table(3000, seed=7), path, row_group_size=1000)
    return path


def read_samples(path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Tokens and input-aligned target flags of every record of a Parquet file (test oracle)."""
    table = pq.read_table(path)
    tokens = [np.asarray(x, dtype=np.int64) for x in table.column("input_ids").to_pylist()]
    masks = [np.asarray(x, dtype=np.int64) for x in table.column("loss_mask").to_pylist()]
    return tokens, masks


def packed_sequences(out_dir) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    """(source_index, source_offset) → (inputs, labels, label loss mask, padded length), read back
    from the raw shard files with plain pyarrow (independent of packer's reader)."""
    out = {}
    for shard in sorted(Path(out_dir).glob("packs-*.arrow")):
        table = pa.ipc.open_file(pa.memory_map(str(shard))).read_all()
        for row in table.to_pylist():
            cu = row["cu_seqlens"]
            for i, s in enumerate(row["seq_lens"]):
                o, e = cu[i], cu[i + 1]
                inputs = np.asarray(row["tokens"][o:o + s])
                labels = np.append(np.asarray(row["tokens"][o + 1:o + s]), row["last_token"][i])
                mask = np.asarray(row["loss_mask"][o:o + s])
                key = (row["source_index"][i], row["source_offset"][i])
                assert key not in out, f"sequence {key} packed twice"
                out[key] = (inputs, labels, mask, e - o)
                assert all(t == row["tokens"][o + s] for t in row["tokens"][o + s:e]) or s == e - o
                assert not any(row["loss_mask"][o + s:e]), "loss on padding"
    return out


@pytest.fixture
def copy(made, tmp_path):
    """``copy(kind)``: a fresh copy of the requesting module's ``made`` outputs (``tests/damage.py``
    makes them) of that kind, to break."""
    return lambda kind: Path(shutil.copytree(made[kind], tmp_path / kind))
