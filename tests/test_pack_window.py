"""``pack --window N``: FFD/BFD planned per window of N input records, packs in window order."""
from __future__ import annotations

import json

import numpy as np
import orjson
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from packer_cli import PackSpec, pack
from packer_cli._sequences import SourceMap
from packer_cli.audit.verify import verify_output
from packer_cli.cli import app
from packer_cli.demo import demo_table
from packer_cli.errors import ConfigError
from packer_cli.pipeline import _window_starts
from packer_cli.spec import Algorithm, BadRecordPolicy, OverlongPolicy, SourceSpec


def source_map(positions) -> SourceMap:
    sources = SourceMap()
    sources.add(np.asarray(positions, dtype=np.int64))
    return sources.finish()


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.integers(0, 4), min_size=1, max_size=60), window=st.integers(1, 12),
       pieces=st.lists(st.integers(0, 3), max_size=60))
def test_window_starts_are_the_first_item_of_each_window_of_records(gaps, window, pieces):
    positions = np.cumsum(np.array(gaps) + 1) - 1  # kept samples' record positions, skipped ones between
    n = positions.size
    sources = source_map(positions)
    probe = np.arange(0, positions[-1] + window + 2)
    brute = [int(np.searchsorted(positions, p, side="left")) for p in probe]  # first kept at or after p
    assert sources.num_samples == n
    assert sources.first_kept_at(probe).tolist() == brute
    # later pieces of split samples (items n + e): extra_sample names each one's sample, in order
    extra = np.repeat(np.arange(n), (pieces + [0] * n)[:n]).astype(np.int64)
    stream = [(int(positions[k]), k) for k in range(n) for _ in range(1 + int((pieces + [0] * n)[k]))]
    windows = [p // window for p, _ in stream]
    expected = [i for i in range(len(stream)) if i == 0 or windows[i] != windows[i - 1]]
    assert _window_starts(sources, extra, window).tolist() == expected


def pack_rows(out) -> list[dict]:
    """The output's packs in output order (each: source_index, source_offset, seq_lens lists)."""
    rows = []
    for entry in json.loads((out / "manifest.json").read_text())["shards"]:
        table = pa.ipc.open_file(pa.memory_map(str(out / entry["name"]))).read_all()
        rows += table.select(["source_index", "source_offset", "seq_lens"]).to_pylist()
    return rows


def write_records(path, table: pa.Table, bad_every: int) -> None:
    """JSON Lines of the table's records, every ``bad_every``-th one malformed (a record position
    that ``--on-bad-record skip`` leaves out, but which still counts in the windows)."""
    lines = []
    for i, record in enumerate(table.to_pylist()):
        lines.append(b'{"input_ids": [1, 2,' if i % bad_every == 5 else orjson.dumps(record))
    path.write_bytes(b"\n".join(lines) + b"\n")


@pytest.mark.parametrize("algorithm,overlong", [(Algorithm.FFD, OverlongPolicy.SPLIT),
                                                (Algorithm.BFD, OverlongPolicy.DROP),
                                                (Algorithm.FFD, OverlongPolicy.TRUNCATE)])
@pytest.mark.filterwarnings("ignore:.*no target tokens")
def test_packs_follow_the_input_in_windows_of_records(tmp_path, algorithm, overlong):
    table = demo_table(1500, seed=4, max_len=3000)
    path = tmp_path / "in.jsonl"
    write_records(path, table, bad_every=97)
    window = 113
    spec = PackSpec(pack_size=1024, cp=2, algorithm=algorithm, overlong=overlong, shuffle=False, window=window)
    summary = pack([str(path)], str(tmp_path / "out"), spec, SourceSpec(on_bad_record=BadRecordPolicy.SKIP))
    assert summary.counts["bad_records"] == 16  # records 5, 102, ..., 1460
    if overlong is OverlongPolicy.SPLIT:
        assert summary.counts["overlong"]["samples"] > 10  # pieces to keep in their sample's window
    rows = pack_rows(tmp_path / "out")
    pack_windows = [{s // window for s in row["source_index"]} for row in rows]
    assert all(len(w) == 1 for w in pack_windows)  # no pack mixes windows of records
    order = [min(w) for w in pack_windows]
    assert order == sorted(order) and len(set(order)) == -(-1500 // window)  # in input order, every window
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert meta["spec"]["window"] == window
    report = verify_output(str(tmp_path / "out"), [str(path)])
    assert report.ok, report.findings


def test_windows_cost_packs_between_the_global_plan_and_next_fit(synthetic_parquet, tmp_path):
    runs = {}
    for name, kwargs in [("global", {}), ("w500", {"window": 500}), ("w50", {"window": 50}),
                         ("sequential", {"algorithm": Algorithm.SEQUENTIAL})]:
        summary = pack([str(synthetic_parquet)], None, PackSpec(pack_size=2048, **kwargs), dry_run=True)
        runs[name] = summary.counts["packs"]
        assert summary.counts["packs"] >= summary.quality["l2_bound"]
    assert runs["global"] <= runs["w500"] <= runs["w50"] < runs["sequential"]
    assert runs["w50"] > runs["global"]  # small windows do cost packs


def test_a_global_plan_records_no_window_and_a_windowed_one_verifies(synthetic_parquet, tmp_path):
    pack([str(synthetic_parquet)], str(tmp_path / "g"), PackSpec(pack_size=2048))
    assert "window" not in json.loads((tmp_path / "g" / "metadata.json").read_text())["spec"]
    pack([str(synthetic_parquet)], str(tmp_path / "w"), PackSpec(pack_size=2048, window=700))
    meta_path = tmp_path / "w" / "metadata.json"
    assert verify_output(str(tmp_path / "w"), [str(synthetic_parquet)]).ok
    meta = json.loads(meta_path.read_text())
    meta["spec"]["window"] = "700"
    meta_path.write_text(json.dumps(meta))
    report = verify_output(str(tmp_path / "w"))
    assert not report.ok and any("window" in f.message and f.check.startswith("metadata") for f in report.findings)


@pytest.mark.parametrize("kwargs,match", [
    ({"window": 0}, "window must be a positive number of records, got 0"),
    ({"window": 2.0}, "window must be an integer"),
    # above an int64: 2**64 failed with a traceback once the finished run wrote its metadata,
    # and 2**63 packed an output that verify could not check
    ({"window": 2**63}, r"^window 9,223,372,036,854,775,808 is above the largest supported, "
                        r"9,223,372,036,854,775,807 records \(a window of at least the input's number"),
    ({"window": 2**64}, "window 18,446,744,073,709,551,616 is above the largest supported"),
    ({"window": 10, "algorithm": Algorithm.SEQUENTIAL}, "applies to ffd and bfd, not sequential"),
    ({"window": 10, "algorithm": Algorithm.FIRST_FIT_SHUFFLE}, "applies to ffd and bfd, not first-fit-shuffle"),
])
def test_pack_refuses_unusable_windows_before_reading(tmp_path, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        pack([str(tmp_path / "absent.jsonl")], str(tmp_path / "out"), PackSpec(pack_size=64, **kwargs))
    assert not (tmp_path / "out").exists()


def test_the_command_line_takes_window_and_shows_it(synthetic_parquet, tmp_path):
    runner = CliRunner(env={"COLUMNS": "200"})  # the summary table's spec line on one line
    out = tmp_path / "out"
    result = runner.invoke(app, ["pack", str(synthetic_parquet), "-o", str(out), "-C", "2048", "--window", "250",
                                 "--no-shuffle"])
    assert result.exit_code == 0, result.output
    assert "ffd in windows of 250 records" in result.output
    assert "in windows of 250 records" in runner.invoke(app, ["inspect", str(out)]).output
    result = runner.invoke(app, ["pack", str(synthetic_parquet), "-o", str(tmp_path / "o2"), "--window", "9",
                                 "--algorithm", "sequential"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: --window applies to ffd and bfd, not sequential (which keeps the input order itself)"]
    result = runner.invoke(app, ["pack", str(synthetic_parquet), "-o", str(tmp_path / "o3"), "--window", str(2**64)])
    assert result.exit_code == 2 and not (tmp_path / "o3").exists()
    assert result.output.strip().splitlines()[0].startswith("error: window 18,446,744,073,709,551,616 is above")


def test_the_largest_window_packs_one_window_that_verifies(synthetic_parquet, tmp_path):
    """2**63 - 1 is taken: one window (the global plan's packs) that verify checks."""
    out = tmp_path / "w"
    pack([str(synthetic_parquet)], str(out), PackSpec(pack_size=2048, window=2**63 - 1))
    pack([str(synthetic_parquet)], str(tmp_path / "g"), PackSpec(pack_size=2048))
    assert json.loads((out / "metadata.json").read_text())["spec"]["window"] == 2**63 - 1
    report = verify_output(str(out), [str(synthetic_parquet)])
    assert report.ok, report.findings
    read = lambda d: [pa.ipc.open_file(str(p)).read_all() for p in sorted(d.glob("packs-*.arrow"))]  # noqa: E731
    assert [t.column("tokens") for t in read(out)] == [t.column("tokens") for t in read(tmp_path / "g")]
    assert not (tmp_path / "o2").exists()


def _resealed(out, edit) -> None:
    """``edit(doc)`` applied to the metadata (a Bridge layout's split's), its checksum made to hold
    again (what verify's data checks must catch without the metadata's own checksum)."""
    from packer_cli.shards.format import seal_metadata

    path = out / "metadata.json" if (out / "metadata.json").exists() else out / "training.metadata.json"
    doc = json.loads(path.read_text())
    edit(doc)
    doc.pop("checksum")
    path.write_text(json.dumps(seal_metadata(doc)))


@pytest.mark.parametrize("fmt", ["native", "megatron-bridge"])
def test_verify_finds_packs_that_mix_windows_or_leave_their_order(synthetic_parquet, tmp_path, fmt):
    runner = CliRunner()
    args = ["pack", str(synthetic_parquet), "-C", "2048", "--format", fmt]
    for name, extra in [("ordered", ["--window", "400", "--no-shuffle"]), ("global", ["--no-shuffle"]),
                        ("shuffled", ["--window", "400"])]:
        assert runner.invoke(app, [*args, "-o", str(tmp_path / name), *extra]).exit_code == 0

    def findings(name):
        result = runner.invoke(app, ["verify", str(tmp_path / name), "--json", "--limit", "1000"])
        report = json.loads(result.stdout)
        return result.exit_code, [f for f in report["findings"] if f["check"] == "pack.window"]

    assert findings("ordered") == (0, [])
    assert runner.invoke(app, ["verify", str(tmp_path / "shuffled")]).exit_code == 0  # each pack in one window

    _resealed(tmp_path / "global", lambda doc: doc["spec"].update(window=400))  # FFD over all 3,000 records
    code, found = findings("global")
    assert code == 1 and len(found) > 50
    assert "mixes windows of 400 records: source indices" in found[0]["message"]

    _resealed(tmp_path / "shuffled", lambda doc: doc["spec"].update(shuffle=False))  # windows, but shuffled
    code, found = findings("shuffled")
    assert code == 1 and found and all("after a pack of window" in f["message"] for f in found)

    _resealed(tmp_path / "ordered", lambda doc: doc["spec"].update(window=200))  # each pack in one window of 400
    code, found = findings("ordered")
    assert code == 1 and any("mixes windows of 200 records" in f["message"] for f in found)


def _expected_window_findings(out, window: int, ordered: bool) -> list[tuple[str, int, str]]:
    """(shard, row, kind) of every pack.window finding, by the rule read plainly off the shards:
    a pack mixes windows where its source indices' windows differ, and (ordered) it goes back
    where its lowest window is below the highest any earlier pack reached, across shards."""
    expected, reached = [], -1
    for entry in json.loads((out / "manifest.json").read_text())["shards"]:
        table = pa.ipc.open_file(pa.memory_map(str(out / entry["name"]))).read_all()
        for row, indices in enumerate(table.column("source_index").to_pylist()):
            windows = [i // window for i in indices]
            if min(windows) != max(windows):
                expected.append((entry["name"], row, "mixes"))
            if ordered and min(windows) < reached:
                expected.append((entry["name"], row, "after"))
            reached = max(reached, max(windows))
    return sorted(expected)


def test_verify_s_window_findings_are_the_rule_s_across_batches_and_shards(synthetic_parquet, tmp_path,
                                                                          monkeypatch):
    """Record batches of 64k tokens and shards of one batch: the order a window reached carries
    over from batch to batch and shard to shard."""
    from packer_cli import pipeline

    monkeypatch.setattr(pipeline, "BATCH_TOKENS", 1 << 16)
    shuffled, ordered_out = tmp_path / "shuffled", tmp_path / "ordered"
    pack([str(synthetic_parquet)], str(shuffled), PackSpec(pack_size=2048, window=400), shard_bytes=1)
    pack([str(synthetic_parquet)], str(ordered_out), PackSpec(pack_size=2048, window=400, shuffle=False),
         shard_bytes=1)
    assert len(list(shuffled.glob("packs-*.arrow"))) > 10
    cases = [(shuffled, 400, True), (shuffled, 150, False), (shuffled, 150, True), (shuffled, 1000, True),
             (ordered_out, 150, True), (ordered_out, 150, False), (ordered_out, 7, True)]
    for out, window, ordered in cases:
        _resealed(out, lambda doc: doc["spec"].update(window=window, shuffle=not ordered))
        report = verify_output(str(out), limit=10_000)
        got = sorted((f.shard, f.row, "mixes" if "mixes" in f.message else "after")
                     for f in report.findings if f.check == "pack.window")
        assert got == _expected_window_findings(out, window, ordered)
        assert got and report.ok == (not got)
