"""Shared set-up of the audit damage tests: a small good output of each kind to break copies of,
and a CLI runner that must never crash."""
from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from packer_cli import pipeline
from packer_cli.cli import app
from packer_cli.demo import demo_table
from packer_cli.spec import PackSpec

runner = CliRunner()


def make_outputs(root: Path, C: int, rows: tuple[int, int], max_len: int, batch_tokens: int) -> dict:
    """A native output of several shards and a Bridge layout with both splits (m = 4), packed
    from ``rows`` demo samples (training, validation) at pack size ``C``."""
    train, val = root / "train.parquet", root / "val.parquet"
    pq.write_table(demo_table(rows[0], seed=3, max_len=max_len), train)
    pq.write_table(demo_table(rows[1], seed=4, max_len=max_len), val)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "BATCH_TOKENS", batch_tokens)  # several batches, hence several shards
        pipeline.pack([str(train)], str(root / "native"), PackSpec(pack_size=C, cp=2), shard_bytes=1)
    for src, split in ((train, "training"), (val, "validation")):
        result = runner.invoke(app, ["pack", str(src), "-o", str(root / "bridge"), "-C", str(C), "--cp", "2",
                                     "--format", "megatron-bridge", "--split", split])
        assert result.exit_code == 0, result.output
    return {"train": train, "val": val, "native": root / "native", "bridge": root / "bridge"}


def run(*args):
    """A CLI command line, which may fail but never with an exception or a traceback."""
    result = runner.invoke(app, [*map(str, args)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    return result

