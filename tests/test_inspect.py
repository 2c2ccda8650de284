"""`packer inspect`: its numbers against values computed independently from the source with numpy.

Per-sample expectations come from the input file alone (runtime length s = min(n−1, cap),
padded p = ⌈s/m⌉·m, targets = Σ loss_mask[1 : s+1]); per-pack facts (how many packs, which
sequences share one) are read from the shards with plain pyarrow. Synthetic data is made
here; /work/shared/data is used when it exists.
"""
from __future__ import annotations

import io
import itertools
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console
from typer.testing import CliRunner

from packer_cli import pipeline
from packer_cli.audit import InspectReport, inspect_output
from packer_cli.audit._histogram import buckets
from packer_cli.audit.store import PackBatch
from packer_cli.cli import app
from packer_cli.plan import martello_toth_l2
from packer_cli.spec import PackSpec

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
runner = CliRunner()


def write_synthetic(path: Path, n: int = 400, seed: int = 1) -> Path:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 400, n)
    lengths[[3, 9]] = 1
    lengths[[20, 21, 22]] = [600, 800, 1500]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = rng.integers(0, 9000, int(lengths.sum())).astype(np.int32)
    pos = np.arange(ids.size) - np.repeat(offsets[:-1], lengths)
    mask = (pos >= np.repeat((lengths * rng.uniform(0.1, 0.9, n)).astype(int), lengths)).astype(np.uint8)
    pq.write_table(pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
                             "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask))}), path)
    return path


def pack_to(src: Path, out: Path, spec: PackSpec) -> Path:
    with pytest.MonkeyPatch.context() as mp:  # small batches → several shards and batches
        mp.setattr(pipeline, "BATCH_TOKENS", 20_000)
        pipeline.pack([str(src)], str(out), spec, shard_bytes=1)
    return out


def expected_from_source(src: Path, C: int, m: int) -> dict:
    """Per-sequence facts of a truncating pack, from the input file alone."""
    table = pq.read_table(src)
    ids, mask = table.column("input_ids").combine_chunks(), table.column("loss_mask").combine_chunks()
    n = np.diff(np.asarray(ids.offsets)).astype(np.int64)
    starts = np.asarray(mask.offsets)[:-1].astype(np.int64)
    flat = np.asarray(mask.values).astype(np.int64)
    cap = C // m * m
    kept = n >= 2
    s = np.minimum(n - 1, cap)[kept]
    cum = np.concatenate([[0], np.cumsum(flat)])
    targets = cum[starts[kept] + 1 + s] - cum[starts[kept] + 1]
    return {"s": s, "p": -(-s // m) * m, "targets": targets, "too_short": int((~kept).sum()),
            "overlong": int((n[kept] - 1 > cap).sum()),
            "sample_targets": dict(zip(np.flatnonzero(kept).tolist(), targets.tolist()))}


def read_packs(out: Path) -> dict:
    """Per-pack facts read straight from the shards with pyarrow (no packer code)."""
    man = json.loads((out / "manifest.json").read_text())
    tables = [pa.ipc.open_file(str(out / e["name"])).read_all() for e in man["shards"]]
    table = pa.concat_tables(tables)
    return {"loads": np.array([len(x) for x in table.column("tokens").to_pylist()]),
            "seqs": np.array([len(x) for x in table.column("seq_lens").to_pylist()]), "table": table}


def check_against_source(report: InspectReport, src: Path, out: Path, C: int, m: int, pad_to_max: bool = False):
    e, packs = expected_from_source(src, C, m), read_packs(out)
    d = report.to_dict()
    t, q, a = d["totals"], d["quality"], d["attention"]
    s, p, P = e["s"], e["p"], packs["loads"].size
    assert t["packs"] == P and t["sequences"] == s.size
    assert t["runtime_tokens"] == s.sum() and t["padded_tokens"] == p.sum() == packs["loads"].sum()
    assert t["target_tokens"] == e["targets"].sum()
    assert t["alignment_padding"] == p.sum() - s.sum() and t["tail_padding"] == P * C - p.sum()
    assert t["tail_padding_pct"] == pytest.approx(100 * (P * C - p.sum()) / (P * C))
    assert t["alignment_padding_pct"] == pytest.approx(100 * (p.sum() - s.sum()) / (P * C))  # of capacity too
    assert q["efficiency"] == pytest.approx(s.sum() / (P * C)) and q["fill"] == pytest.approx(p.sum() / (P * C))
    assert q["lower_bound"] == -(-p.sum() // C) and q["gap_to_lower_bound"] == P - -(-p.sum() // C)
    assert q["l2_bound"] == martello_toth_l2(p, C) and q["gap_to_l2"] == P - q["l2_bound"]
    L = d["sequence_length"]
    assert (L["min"], L["max"], L["median"], L["p90"]) == (s.min(), s.max(), np.median(s), np.percentile(s, 90))
    spp = d["sequences_per_pack"]
    assert (spp["min"], spp["median"], spp["max"]) == (packs["seqs"].min(), np.median(packs["seqs"]), packs["seqs"].max())
    hist = d["histograms"]["sequence_length"]
    assert hist["values"] == np.unique(s).tolist() and hist["counts"] == np.unique(s, return_counts=True)[1].tolist()
    T = np.full(P, C) if pad_to_max else packs["loads"]
    assert a["sum_sq_real"] == (s * s).sum() and a["sum_sq_pack"] == (T.astype(np.int64) ** 2).sum()
    assert a["overstatement"] == pytest.approx((T.astype(np.int64) ** 2).sum() / (s * s).sum())
    assert a["linear_real_share"] == pytest.approx(s.sum() / T.sum())
    assert d["recorded"]["too_short_dropped"] == e["too_short"]
    assert d["recorded"]["overlong"]["samples"] == e["overlong"]
    return d, e


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect")
    src = write_synthetic(root / "train.parquet")
    return src, pack_to(src, root / "out", PackSpec(pack_size=512, cp=2, tp=2, sp=True))


def test_numbers_match_independent_computation(synth):
    src, out = synth
    assert len(json.loads((out / "manifest.json").read_text())["shards"]) > 2
    result = runner.invoke(app, ["inspect", str(out), "--json"])
    assert result.exit_code == 0, result.output
    check_against_source(InspectReport.from_dict(json.loads(result.output)), src, out, 512, 4)


def test_pad_to_max_length_counts_full_packs(tmp_path, synth):
    out = pack_to(synth[0], tmp_path / "out", PackSpec(pack_size=512, cp=2, pad_to_max_length=True))
    check_against_source(inspect_output(str(out)), synth[0], out, 512, 4, pad_to_max=True)


@pytest.mark.parametrize("name", ["sft_gsm8k.parquet", "sft_codealpaca.parquet"])
def test_real_data(tmp_path, name):
    src = DATA / name
    if not src.exists():
        pytest.skip(f"{src} not available")
    out = pack_to(src, tmp_path / "out", PackSpec(pack_size=4096, cp=2, tp=2, sp=True))
    d, _ = check_against_source(inspect_output(str(out)), src, out, 4096, 4)
    readme = {"sft_gsm8k.parquet": (7473, 1_252_770), "sft_codealpaca.parquet": (6552, 684_452)}[name]
    assert d["totals"]["sequences"] == readme[0] and d["totals"]["runtime_tokens"] == readme[1] - readme[0]
    assert d["attention"]["overstatement"] > 10  # short SFT samples in 4K packs: the naive count is far off


def test_pack_detail(synth):
    src, out = synth
    e, table = expected_from_source(src, 512, 4), read_packs(out)["table"]
    n = 7
    row = {c: table.column(c)[n].as_py() for c in ("source_index", "seq_lens", "cu_seqlens", "source_offset")}
    result = runner.invoke(app, ["inspect", str(out), "--pack", str(n), "--json"])
    detail = json.loads(result.output)["pack"]
    assert detail["pack"] == n and detail["source_index"] == row["source_index"]
    assert detail["real_len"] == row["seq_lens"] and detail["padded_len"] == np.diff(row["cu_seqlens"]).tolist()
    assert detail["start"] == row["cu_seqlens"][:-1] and detail["pack_len"] == row["cu_seqlens"][-1]
    assert detail["target_tokens"] == [e["sample_targets"][i] for i in row["source_index"]]
    text = runner.invoke(app, ["inspect", str(out), "--pack", str(n)], terminal_width=140).output
    assert f"pack {n} (" in text and all(str(i) in text for i in row["source_index"])


def test_a_report_with_a_packs_detail_round_trips_with_it(synth):
    """from_dict is to_dict's inverse for the ``--pack`` document too: the detail comes back."""
    report = inspect_output(str(synth[1]), pack=7)
    assert report.detail is not None and report.detail.pack == 7
    back = InspectReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert back.detail == report.detail
    assert back.to_dict() == report.to_dict()


def test_reads_only_the_columns_it_needs(synth, monkeypatch):
    seen = set()
    original = PackBatch.column

    def spy(self, name):
        seen.add(name)
        return original(self, name)

    monkeypatch.setattr(PackBatch, "column", spy)
    inspect_output(str(synth[1]))
    assert seen == {"cu_seqlens", "seq_lens", "loss_mask"}


def test_reports_merge_and_round_trip():
    spec = {"pack_size": 16}
    a = InspectReport.partial(out="o", spec=spec, recorded={}, real=[3, 5, 16], padded=[4, 8, 16], seq_counts=[2, 1],
                              target_tokens=7)
    b = InspectReport.partial(out="o", spec=spec, recorded={}, real=[1, 9], padded=[4, 12], seq_counts=[2],
                              target_tokens=2)
    whole = InspectReport.partial(out="o", spec=spec, recorded={}, real=[3, 5, 16, 1, 9], padded=[4, 8, 16, 4, 12],
                                  seq_counts=[2, 1, 2], target_tokens=9)
    assert (a + b).to_dict() == whole.to_dict() == (b + a).to_dict()
    assert InspectReport.from_dict(whole.to_dict()).to_dict() == whole.to_dict()
    broken = {k: v for k, v in whole.to_dict().items() if k != "histograms"}
    with pytest.raises(ValueError, match="not an inspect report as to_dict\\(\\) writes it: key 'histograms' is missing"):
        InspectReport.from_dict(broken)
    d = whole.to_dict()
    assert d["totals"]["packs"] == 3 and d["totals"]["tail_padding"] == 3 * 16 - 44
    assert d["attention"]["sum_sq_pack"] == 12 ** 2 + 16 ** 2 + 16 ** 2
    assert d["sequences_per_pack"] == {"count": 3, "min": 1, "max": 2, "mean": 5 / 3, "median": 2.0, "p90": 2.0,
                                       "p99": 2.0}


@pytest.mark.parametrize("C,n", [(64, 500), (4096, 300), (1 << 20, 50)])
def test_bounds_come_from_the_histogram_alone(C, n):
    """L2 from the padded-length histogram equals the bound of the lengths themselves (a
    histogram of C sizes, or a sort when C > 4N); a length no pack can hold gives none."""
    rng = np.random.default_rng(C)
    padded = rng.integers(1, C + 1, n)
    report = InspectReport.partial(out="o", spec={"pack_size": C}, recorded={}, real=padded, padded=padded,
                                   seq_counts=[n], target_tokens=0)
    assert report.bounds() == (-(-int(padded.sum()) // C), martello_toth_l2(padded, C))
    for bad in (0, C + 1):
        odd = InspectReport.partial(out="o", spec={"pack_size": C}, recorded={}, real=[1, bad], padded=[1, bad],
                                    seq_counts=[2], target_tokens=0)
        assert odd.bounds()[1] is None


def test_rich_rendering(synth):
    buf = io.StringIO()
    Console(file=buf, width=100).print(inspect_output(str(synth[1]), pack=0))
    text = buf.getvalue()
    for label in ("packs", "tail padding", "Martello–Toth L2", "overstates attention by", "sequence length",
                  "pack fill", "sequences per pack", "█", "pack 0 ("):
        assert label in text, label


@pytest.mark.parametrize("width", [40, 60, 100])
def test_histograms_keep_their_ranges_and_counts_on_a_narrow_terminal(synth, width):
    """The bar was 40 cells whatever the width: at 40 columns rich squeezed the range and
    count columns to nothing and only bars were left."""
    report = inspect_output(str(synth[1]))
    buf = io.StringIO()
    Console(file=buf, width=width).print(report)
    text = buf.getvalue()
    for title, hist in (("sequence length (real runtime tokens)", report.real_hist),
                        ("sequences per pack", report.seqs_hist)):
        after = text.split(title)[-1].splitlines()[1:]  # the histogram's title: the summary names it too
        # the rows are indented (cell padding); the next title or table is not
        rows = [line.split() for line in itertools.takewhile(lambda line: line.startswith(" "), after)]
        expected = buckets(hist, 16)
        assert [int(r[-1].replace(",", "")) for r in rows] == [c for _, _, c in expected], text
        assert [r[0] for r in rows] == [f"{lo:,}–{hi:,}" if hi > lo else f"{lo:,}" for lo, hi, _ in expected]
        bars = [len(r[1]) for r in rows if len(r) == 3]
        assert max(bars) == min(40, width - max(len(r[0]) for r in rows) - max(len(r[-1]) for r in rows) - 6)
        assert all(len(line) <= width for line in text.splitlines())


def _fill_rows(report) -> list[tuple[str, int]]:
    buf = io.StringIO()
    Console(file=buf, width=100).print(report)
    lines = buf.getvalue().split("pack fill (Σp / C)")[1].split("sequences per pack")[0].splitlines()
    return [(line.split()[0], int(line.split()[-1])) for line in lines if line.strip()]


def test_fill_histogram_labels_are_the_packs_fills():
    """Each fill bucket's label spans the fills Σp/C of the loads it counts: a full pack is at
    100%, never above (pack.capacity), and a bucket of one load shows that load's fill."""
    C = 16
    loads = [8, 16, 16]                      # fills 50% and 100%: one load per bucket (width 1)
    report = InspectReport.partial(out="o", spec={"pack_size": C}, recorded={}, real=loads, padded=loads,
                                   seq_counts=[1, 1, 1], target_tokens=0)
    rows = _fill_rows(report)
    assert rows[0] == (f"{100 * 8 / C:.1f}%", 1) and rows[-1] == (f"{100 * 16 / C:.1f}%", 2), rows
    assert [count for _, count in rows] == [1] + [0] * 7 + [2]
    full = InspectReport.partial(out="o", spec={"pack_size": C}, recorded={}, real=[C] * 4, padded=[C] * 4,
                                 seq_counts=[1] * 4, target_tokens=0)
    assert _fill_rows(full) == [("100.0%", 4)]
    # wider buckets: 16 loads 5..36 at C=36 → width 2, the last bucket holds 35 and 36 (97.2–100.0%)
    loads = list(range(5, 37))
    wide = InspectReport.partial(out="o", spec={"pack_size": 36}, recorded={}, real=loads, padded=loads,
                                 seq_counts=[1] * len(loads), target_tokens=0)
    rows = _fill_rows(wide)
    assert rows[0] == (f"{100 * 5 / 36:.1f}–{100 * 6 / 36:.1f}%", 2) and rows[-1] == ("97.2–100.0%", 2), rows


def test_errors_exit_codes(synth, tmp_path):
    assert runner.invoke(app, ["inspect", str(tmp_path / "nope")]).exit_code == 2
    result = runner.invoke(app, ["inspect", str(synth[1]), "--pack", "100000"])
    assert result.exit_code == 2 and "out of range" in result.output
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "metadata.json").write_text("{oops")
    result = runner.invoke(app, ["inspect", str(broken)])
    assert result.exit_code == 1 and "metadata.json: empty or corrupted JSON" in result.output


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_json_failures_still_print_a_document(synth, tmp_path, command):
    """--json: whatever stops the command (not an output, an unreadable shard), stdout holds one
    JSON document with ``ok: false``, the exit code and the error line."""
    broken = tmp_path / "broken"
    shutil.copytree(synth[1], broken)
    shard = sorted(broken.glob("packs-*.arrow"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-20] ^= 0xFF  # inside the Arrow footer
    shard.write_bytes(bytes(raw))
    for out, code in ((tmp_path / "nothing", 2), (tmp_path, 2), (broken, 1)):
        result = runner.invoke(app, [command, str(out), "--json"])
        assert result.exit_code == code, result.output
        doc = json.loads(result.stdout)
        assert doc["ok"] is False and doc["exit_code"] == code and doc["out"] == str(out), doc
        if command == "inspect" or code == 2:
            assert doc["error"] and "\n" not in doc["error"], doc


def test_json_of_an_inconsistent_output_lists_the_findings(synth, tmp_path):
    """With --json a pipeline reading stdout gets the failed checks, not an empty page."""
    out = tmp_path / "copy"
    shutil.copytree(synth[1], out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["shards"] = manifest["shards"][:-1] if len(manifest["shards"]) > 1 else []
    (out / "manifest.json").write_text(json.dumps(manifest))
    result = runner.invoke(app, ["inspect", str(out), "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["error"].startswith(f"{out}: not summarized")
    checks = {f["check"] for f in doc["findings"]}
    assert {"structure.files", "structure.totals"} <= checks, checks


def test_pack_out_of_range_in_one_of_two_bridge_splits_names_that_split(tmp_path, synthetic_parquet):
    """Each split counts its packs from 0: "OUT has 8 packs" was wrong for a layout whose other
    split held more, and did not say which split had too few."""
    small = tmp_path / "small.parquet"
    pq.write_table(pq.read_table(synthetic_parquet).slice(0, 20), small)
    out = tmp_path / "bridge"
    assert runner.invoke(app, ["pack", str(synthetic_parquet), "-o", str(out), "--format", "megatron-bridge",
                               "--pack-size", "512"]).exit_code == 0
    assert runner.invoke(app, ["pack", str(small), "-o", str(out), "--format", "megatron-bridge", "--split",
                               "validation", "--pack-size", "512"]).exit_code == 0
    training = inspect_output(str(out), split="training").packs
    validation = inspect_output(str(out), split="validation").packs
    assert validation < training
    result = runner.invoke(app, ["inspect", str(out), "--pack", str(validation)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == (
        f"error: --pack {validation} is out of range: {out} split validation has {validation} packs "
        f"(0..{validation - 1})")
    assert "out of range" not in runner.invoke(app, ["inspect", str(out), "--pack", str(validation),
                                                     "--split", "training"]).output


def test_percentiles_are_numpys_bit_for_bit():
    # a + (b - a)·t for every t gave 42.400000000000006 where numpy gives 42.4 (AUDIT.md: "as numpy.percentile")
    import numpy as np

    from packer_cli.audit._histogram import Hist, percentile

    rng = np.random.default_rng(7)
    assert percentile(Hist.of([15, 24, 24, 34, 48]), 90) == np.percentile([15, 24, 24, 34, 48], 90) == 42.4
    for _ in range(2000):
        values = rng.integers(0, 60, rng.integers(1, 12))
        for q in (50, 90, 99):
            assert percentile(Hist.of(values), q) == np.percentile(values, q)


def test_buckets_are_at_most_n_of_one_width_covering_every_value():
    """Whatever the range (one that n does not divide, narrower than n, a single value): at most n
    buckets, each as wide as the first but the last (cut at the highest value), together holding
    every value once."""
    from packer_cli.audit._histogram import Hist, buckets

    rng = np.random.default_rng(5)
    for lo, hi, n in [(100, 119, 16), (0, 16, 16), (5, 9, 16), (7, 7, 16), (1, 4096, 16), (3, 1000, 7)]:
        values = np.concatenate([[lo, hi], rng.integers(lo, hi + 1, 200)])
        got = buckets(Hist.of(values), n)
        width = got[0][1] - got[0][0] + 1
        assert 1 <= len(got) <= n, (lo, hi, n, len(got))
        assert got[0][0] == lo and got[-1][1] == hi
        assert all(b[0] == a[1] + 1 for a, b in zip(got, got[1:]))
        assert all(b[1] - b[0] + 1 == width for b in got[:-1]) and got[-1][1] - got[-1][0] + 1 <= width
        assert [c for *_, c in got] == [int(((values >= a) & (values <= b)).sum()) for a, b, _ in got]
        assert sum(c for *_, c in got) == values.size


def test_histograms_hold_what_the_values_hold_whatever_their_range():
    """Counted (small values) or sorted (values past 2^16 and 4 per value), merged in any order,
    read back from a document: the same histogram, and the same figures as NumPy's. A pack
    size of 2^24 made every shard's load histogram 16M entries; a document naming 2^40 asked
    for 8 TB."""
    from packer_cli.audit._histogram import Hist, buckets, from_sparse, summarize, to_sparse

    rng = np.random.default_rng(3)
    for top in (10, 1 << 16, 1 << 24, 1 << 40):
        parts = [rng.integers(0, top, rng.integers(0, 300)) for _ in range(4)] + [np.array([top - 1])]
        everything = np.concatenate(parts)
        merged = sum((Hist.of(p) for p in parts), start=Hist())
        assert merged == Hist.of(everything) == from_sparse(to_sparse(merged))
        values, counts = np.unique(everything, return_counts=True)
        assert to_sparse(merged) == {"values": values.tolist(), "counts": counts.tolist()}
        assert summarize(merged)["mean"] == int(everything.sum()) / everything.size  # exact, then one rounding
        assert summarize(merged)["p90"] == np.percentile(everything, 90)
        assert sum(c for *_, c in buckets(merged, 16)) == everything.size
        assert merged.count(int(values[0])) == counts[0] and merged.count(-1) == 0
    assert from_sparse({"values": [], "counts": []}) == Hist()
    for bad in ({"values": [-1], "counts": [1]}, {"values": [1], "counts": [-2]}, {"values": [1, 2], "counts": [1]},
                {"values": [7, 3], "counts": [1, 2]}, {"values": [3, 3], "counts": [1, 2]},
                {"values": [3], "counts": [0]}, {"values": [1.5], "counts": [1]}, {"values": ["7"], "counts": [1]},
                {"values": [True], "counts": [1]}, {"values": 3, "counts": 1}, {"values": [[1, 2]], "counts": [1]},
                {"values": [2 ** 62], "counts": [4]}, {"values": [5, 6], "counts": [2 ** 62, 2 ** 62]},
                {"values": [2 ** 63 - 1], "counts": [1]}, {"values": [1e300], "counts": [1]},
                {"values": [2 ** 40], "counts": [2 ** 40]}, {"values": [1, 2], "counts": [2 ** 40, 1]}):
        with pytest.raises(ValueError):
            from_sparse(bad)
    with pytest.raises(ValueError):
        Hist.of([3, -1])


def test_a_partial_report_takes_empty_packs_anywhere():
    # a last pack of no sequence: IndexError in np.add.reduceat
    from packer_cli.audit.report import InspectReport

    for counts in ([1, 0], [0, 1], [2, 0, 1]):
        n = sum(counts)
        report = InspectReport.partial(out="x", spec={"pack_size": 64}, recorded={}, real=[3] * n, padded=[4] * n,
                                       seq_counts=counts, target_tokens=0)
        assert report.packs == len(counts) and report.pack_len_total == 4 * n
        assert report.load_hist.count(0) == counts.count(0) and report.load_hist.total == len(counts)


def test_the_summarys_recorded_counts_have_thousands_separators(tmp_path):
    """The over-long row printed its counts bare ("55025 tokens lost") where every other count
    in the table, and pack's own summary line, has separators."""
    src = tmp_path / "long.jsonl"
    src.write_text("".join(json.dumps({"input_ids": list(range(1, 400))}) + "\n" for _ in range(180)))
    from packer_cli import pack
    pack([str(src)], str(tmp_path / "out"), PackSpec(pack_size=64))
    report = inspect_output(str(tmp_path / "out"))
    lost = report.to_dict()["recorded"]["overlong"]["tokens_lost"]
    assert lost >= 10_000
    buf = io.StringIO()
    Console(file=buf, width=140).print(report)
    assert f"180 samples, {lost:,} tokens lost" in buf.getvalue()


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_missing_output_is_named_as_missing_not_as_no_directory(tmp_path, command):
    """pack says "no such file or directory" of a missing input; inspect and verify called a
    missing OUT "not a directory", which a file is."""
    missing = runner.invoke(app, [command, str(tmp_path / "nope")])
    assert missing.exit_code == 2 and missing.output.strip() == f"error: {tmp_path / 'nope'}: no such file or directory"
    (tmp_path / "file").write_text("")
    a_file = runner.invoke(app, [command, str(tmp_path / "file")])
    assert a_file.exit_code == 2 and a_file.output.strip() == f"error: {tmp_path / 'file'}: not a directory"
    # a "latest" link whose target was cleaned up: missing too, as pack says of it
    (tmp_path / "latest").symlink_to(tmp_path / "gone")
    dangling = runner.invoke(app, [command, str(tmp_path / "latest")])
    assert dangling.exit_code == 2 and dangling.output.strip() == f"error: {tmp_path / 'latest'}: no such file or directory"
    # a loop of links is no missing output: its reason, as pack gives it of an input
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    loop = runner.invoke(app, [command, str(tmp_path / "loop")])
    assert loop.exit_code == 2 and loop.output.strip() == f"error: {tmp_path / 'loop'}: too many levels of symbolic links"


def test_verifys_verdict_gives_a_small_outputs_rate_in_thousands(tmp_path):
    """A few thousand tokens checked in a second read "(0M tokens/s)"."""
    src = tmp_path / "small.jsonl"
    src.write_text("".join(json.dumps({"input_ids": list(range(1, 60))}) + "\n" for _ in range(40)))
    result = runner.invoke(app, ["pack", str(src), "-o", str(tmp_path / "out"), "-C", "256"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["verify", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    rate = re.search(r"\(([\d,]+)(k?) tokens/s\)\)$", result.output.strip())
    assert rate and int(rate.group(1).replace(",", "")) > 0, result.output  # a few thousand tokens: well below a million a second


def test_verifys_verdict_counts_one_pack_in_the_singular(tmp_path):
    """It said "(1 packs, 60 tokens)"."""
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps({"input_ids": list(range(1, 61))}) + "\n")
    assert runner.invoke(app, ["pack", str(src), "-o", str(tmp_path / "out"), "-C", "64"]).exit_code == 0
    result = runner.invoke(app, ["verify", str(tmp_path / "out")])
    assert result.exit_code == 0 and "verify: OK: " in result.output, result.output
    assert re.search(r"\(1 pack, \d+ tokens checked in ", result.output), result.output


@pytest.mark.parametrize("name", ["run[v2]", "od[/b]", "run:100:"])
def test_a_report_printed_by_any_console_names_its_output_as_it_is(synth, tmp_path, name):
    """The titles were rich markup and emoji codes: printed by a plain rich Console (the
    library's users print reports so), "run[v2]" lost "[v2]", "od[/b]" raised a MarkupError
    and "run:100:" became "run💯"."""
    from rich.console import Console as RichConsole

    (tmp_path / "od[").mkdir()
    out = tmp_path / name
    shutil.copytree(synth[1], out)
    buf = io.StringIO()
    RichConsole(file=buf, width=400).print(inspect_output(str(out), pack=0))
    assert f"packer inspect → {out}" in buf.getvalue() and "pack 0 (packs-00000.arrow row 0" in buf.getvalue()


def test_a_long_out_path_is_printed_whole_on_the_title_line(synth, tmp_path):
    """The title was the table's, wrapped at the table's width: a long OUT came out broken over
    lines padded with spaces even where the console had room for it. The CLI prints it whole on
    one line (the terminal wraps it); a plain console of room enough holds it on one line too, and
    a narrow one folds it at its own width."""
    from rich.console import Console as RichConsole

    out = tmp_path / ("d" * 70) / ("e" * 40) / "out"
    shutil.copytree(synth[1], out)
    result = runner.invoke(app, ["inspect", str(out)])
    assert result.exit_code == 0, result.output
    assert f"packer inspect → {out}\n" in result.output, result.output
    buf = io.StringIO()
    RichConsole(file=buf, width=400).print(inspect_output(str(out)))
    assert buf.getvalue().startswith(f"packer inspect → {out}\n"), buf.getvalue()
    buf = io.StringIO()
    RichConsole(file=buf, width=60).print(inspect_output(str(out)))
    lines = buf.getvalue().splitlines()
    head = "".join(line.strip() for line in lines[:lines.index(next(line for line in lines if line.startswith("┌")))])
    assert head == f"packer inspect →{out}" and max(map(len, lines)) <= 60


def test_a_recorded_string_in_the_summary_table_is_escaped_one_line_a_cell(tmp_path):
    """inspect shows the metadata's over-long policy as recorded (verify judges it): a newline in
    it broke its cell over two rows, and an escape sequence reached the terminal."""
    from packer_cli.shards.format import metadata_checksum

    (tmp_path / "f.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    out = tmp_path / "out"
    assert runner.invoke(app, ["pack", str(tmp_path / "f.jsonl"), "-o", str(out)]).exit_code == 0
    meta = json.loads((out / "metadata.json").read_text())
    meta["counts"]["overlong"]["policy"] = "x\ny\x1b[2J"
    meta["checksum"]["xxh3_64"] = metadata_checksum(meta)  # an edit inspect does not refuse
    (out / "metadata.json").write_text(json.dumps(meta))
    result = runner.invoke(app, ["inspect", str(out)], terminal_width=140)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output
    lines = result.output.splitlines()
    table = lines[1:lines.index(next(line for line in lines if line.startswith("└"))) + 1]
    assert all(line[0] in "┌│└" for line in table), result.output  # no row broken over lines
    assert any(line.startswith("│ over-long (x\\ny\\x1b[2J)") for line in table), result.output


def test_equal_reports_compare_equal(synth):
    """The generated == met the histograms' arrays: "truth value of an array is ambiguous"."""
    report = inspect_output(str(synth[1]))
    assert report == InspectReport.from_dict(report.to_dict())
    assert report != InspectReport(out=report.out, spec=report.spec, recorded=report.recorded)
    assert report != report.to_dict()


def test_a_damaged_shard_of_an_output_named_like_its_shards_is_named_within_it(synth, tmp_path, monkeypatch):
    """An OUT whose name began the shard's (``packs``) was taken as already named."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(synth[1], tmp_path / "packs")
    shard = tmp_path / "packs" / "packs-00000.arrow"
    raw = bytearray(shard.read_bytes())
    raw[-200:-10] = b"\xff" * 190  # the footer: the same size, so only reading it fails
    shard.write_bytes(bytes(raw))
    result = runner.invoke(app, ["inspect", "packs"])
    assert result.exit_code == 1 and result.output.startswith("error: packs: packs-00000.arrow: "), result.output
    assert result.output.strip().endswith("run `packer verify` for a full report")


def test_a_pack_past_an_output_of_one_pack_counts_it_in_the_singular(tmp_path):
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps({"input_ids": list(range(1, 61))}) + "\n")
    assert runner.invoke(app, ["pack", str(src), "-o", str(tmp_path / "out"), "-C", "64"]).exit_code == 0
    result = runner.invoke(app, ["inspect", str(tmp_path / "out"), "--pack", "3"])
    assert result.exit_code == 2 and result.output.strip() == (
        f"error: --pack 3 is out of range: {tmp_path / 'out'} has 1 pack (0..0)")


def test_the_readers_name_a_missing_output_as_missing(tmp_path):
    """PackedReader called a missing path, or a link to nothing, "not a directory"."""
    from packer_cli.errors import DataError
    from packer_cli.shards.reader import PackedReader

    (tmp_path / "latest").symlink_to(tmp_path / "gone")
    (tmp_path / "file").write_text("")
    for name, says in (("missing", "no such file or directory"), ("latest", "no such file or directory"),
                       ("file", "not a directory")):
        with pytest.raises(DataError, match=f"^{re.escape(str(tmp_path / name))}: {says}$"):
            PackedReader(str(tmp_path / name))


def test_counts_of_one_are_in_the_singular_in_both_summaries_and_errors(tmp_path, monkeypatch):
    """'1 samples, 1 tokens lost' (inspect, and pack's summary), 'and 1 more inputs',
    'out of range for 1 packs'."""
    from packer_cli.plan import plan_packs
    from packer_cli.shards.reader import PackedReader

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_text(json.dumps({"input_ids": list(range(1, 67))}) + "\n")  # 1 token past C
    packed = runner.invoke(app, ["pack", "a.jsonl", "-o", "out", "-C", "64"])
    assert packed.exit_code == 0 and "1 sample, 1 token / 1 target lost" in packed.output, packed.output
    buf = io.StringIO()
    Console(file=buf, width=140).print(inspect_output("out"))
    assert "1 sample, 1 token lost, 0 extra pieces" in buf.getvalue(), buf.getvalue()
    for name in ("b.jsonl", "c.jsonl"):
        (tmp_path / name).write_text(json.dumps({"input_ids": [1]}) + "\n")
    nothing = runner.invoke(app, ["pack", "b.jsonl", "c.jsonl", "-o", "none"])
    assert "error: b.jsonl and 1 more input: no samples left to pack: of 2 records" in nothing.output, nothing.output
    with pytest.raises(IndexError, match="^pack 1 out of range for 1 pack$"):
        plan_packs([5], 8).pack_items(1)
    with pytest.raises(IndexError, match="^pack 1 out of range for 1 pack$"):
        PackedReader("out").row(1)


def test_a_native_pack_index_one_past_either_end_is_an_index_error(synth):
    """As for a Bridge split: a negative index counts from the end, -n being the first pack; on
    a native output of several shards row(-n) was out of range, or every negative index failed
    with NumPy's IndexError naming no pack."""
    from packer_cli.shards.reader import PackedReader

    reader = PackedReader(str(synth[1]))
    n = len(reader)
    assert len(reader._starts) > 3  # several record batches
    for i in (-1, -2, -n // 2, -n):
        assert reader.row(i).tokens.tolist() == reader.row(n + i).tokens.tolist(), i
    assert reader.row(-1).tokens.tolist() != reader.row(0).tokens.tolist()
    for i in (n, -n - 1):
        with pytest.raises(IndexError, match=f"^pack {i} out of range for {n} packs$"):
            reader.row(i)


def test_a_recorded_policy_is_printed_as_text_by_any_console(synth, tmp_path):
    """The over-long row's label carries the metadata's policy, which a plain rich Console read
    as markup ('od[/b]' raised a MarkupError)."""
    from rich.console import Console as RichConsole

    report = inspect_output(str(synth[1]))
    report.recorded = {**report.recorded, "overlong": {**(report.recorded.get("overlong") or {}), "policy": "od[/b]"}}
    buf = io.StringIO()
    RichConsole(file=buf, width=200).print(report)
    assert "over-long (od[/b])" in buf.getvalue()


def test_pack_detail_of_many_sequences_is_listed_as_plain_text(synth, monkeypatch):
    """Beyond DETAIL_TABLE_ROWS sequences the pack is listed as aligned plain text (rich drew a
    77k-row table in 33 s): a header, then one line a sequence with the same cells."""
    from packer_cli.audit import _render

    src, out = synth
    n = 7
    detail = json.loads(runner.invoke(app, ["inspect", str(out), "--pack", str(n), "--json"]).output)["pack"]
    monkeypatch.setattr(_render, "DETAIL_TABLE_ROWS", 1)
    text = runner.invoke(app, ["inspect", str(out), "--pack", str(n)], terminal_width=200).output
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split() == ["seq", "source", "index", "offset", "start",
                                                                    "real", "padded", "targets"])
    rows = [line.split() for line in lines[head + 1:head + 1 + len(detail["real_len"])]]
    assert len(detail["real_len"]) > 1 and len(rows) == len(detail["real_len"])
    for k, cells in enumerate(rows):
        assert cells == [str(k), str(detail["source_index"][k]), str(detail["source_offset"][k]),
                         f"{detail['start'][k]:,}", f"{detail['real_len'][k]:,}", f"{detail['padded_len'][k]:,}",
                         f"{detail['target_tokens'][k]:,}"]


def test_pack_detail_as_plain_text_keeps_every_cell_on_a_narrow_terminal(synth, monkeypatch):
    """On a terminal narrower than a line the plain list folds its lines instead of cutting off
    the last columns."""
    from packer_cli.audit import _render

    src, out = synth
    detail = json.loads(runner.invoke(app, ["inspect", str(out), "--pack", "7", "--json"]).output)["pack"]
    monkeypatch.setattr(_render, "DETAIL_TABLE_ROWS", 1)
    text = runner.invoke(app, ["inspect", str(out), "--pack", "7"], terminal_width=20).output
    flat = "".join(text.split())
    for k in range(len(detail["real_len"])):
        assert (f"{detail['padded_len'][k]:,}{detail['target_tokens'][k]:,}") in flat


def test_the_text_report_shows_the_json_reports_figures(synth):
    """The table rows are the JSON's numbers: efficiency as a percentage of 100, and Σ T² the
    pack-as-one-sequence sum (not the padded sequences')."""
    out = synth[1]
    d = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).output)
    text = runner.invoke(app, ["inspect", str(out)], terminal_width=150).output
    row = lambda label: next(line for line in text.splitlines() if label in line)  # noqa: E731
    assert f"{100 * d['quality']['efficiency']:.2f}%" in row("efficiency (real / packs·C)")
    assert f"{d['attention']['sum_sq_pack']:,}" in row("Σ T² (pack as one sequence)")
    assert f"{d['attention']['sum_sq_real']:,}" in row("Σ s_i² (real sequences)")
    assert d["attention"]["sum_sq_pack"] != d["attention"]["sum_sq_padded"]


def test_pack_detail_counts_each_sequences_own_targets_and_finds_its_row(tmp_path):
    """Every token a target (no mask field) and no padding between sequences: a sequence's
    targets are its real length, not one more taken from the next sequence; and a pack's row is
    counted in packs across a shard's several record batches."""
    src = tmp_path / "train.jsonl"
    rng = np.random.default_rng(4)
    src.write_text("".join(json.dumps({"input_ids": rng.integers(1, 900, n).tolist()}) + "\n"
                           for n in rng.integers(20, 200, 60)))
    with pytest.MonkeyPatch.context() as mp:  # one shard of several record batches
        mp.setattr(pipeline, "BATCH_TOKENS", 2048)
        pipeline.pack([str(src)], str(tmp_path / "out"), PackSpec(pack_size=512), shard_bytes=1 << 30)
    table = read_packs(tmp_path / "out")["table"]
    assert len(json.loads((tmp_path / "out" / "manifest.json").read_text())["shards"]) == 1
    with pa.ipc.open_file(str(tmp_path / "out" / "packs-00000.arrow")) as shard:
        assert shard.num_record_batches > 2
    n = table.num_rows - 2
    detail = json.loads(runner.invoke(app, ["inspect", str(tmp_path / "out"), "--pack", str(n), "--json"]).output)
    detail = detail["pack"]
    assert (detail["pack"], detail["shard"], detail["row"]) == (n, "packs-00000.arrow", n)
    from packer_cli.shards.reader import PackedReader

    # the reader's messages name the row as counted in the file too, not within its record batch
    assert PackedReader(str(tmp_path / "out")).locate(n) == f"{tmp_path / 'out' / 'packs-00000.arrow'} row {n}"
    assert detail["target_tokens"] == detail["real_len"] == table.column("seq_lens")[n].as_py()


def test_pack_detail_of_exactly_detail_table_rows_sequences_is_still_a_table(synth, monkeypatch):
    """A pack of exactly DETAIL_TABLE_ROWS sequences is drawn as a table (with borders); only a
    pack of more is listed as plain text."""
    from packer_cli.audit import _render

    src, out = synth
    detail = json.loads(runner.invoke(app, ["inspect", str(out), "--pack", "7", "--json"]).output)["pack"]
    monkeypatch.setattr(_render, "DETAIL_TABLE_ROWS", len(detail["real_len"]))
    text = runner.invoke(app, ["inspect", str(out), "--pack", "7"], terminal_width=200).output
    head = next(line for line in text.splitlines() if "source index" in line)
    assert "┃" in head or "│" in head, text
    monkeypatch.setattr(_render, "DETAIL_TABLE_ROWS", len(detail["real_len"]) - 1)
    text = runner.invoke(app, ["inspect", str(out), "--pack", "7"], terminal_width=200).output
    head = next(line for line in text.splitlines() if "source index" in line)
    assert "┃" not in head and "│" not in head, text


def test_an_empty_histogram_bucket_draws_no_bar():
    """A histogram row counting nothing shows no bar, while the smallest non-zero count still
    shows a sliver and the largest the full width."""
    from packer_cli.audit._render import bar

    assert bar(0, 1000) == ""
    assert bar(1, 10**6) == "▏"
    assert bar(1000, 1000, 10) == "█" * 10


def test_numbers_count_every_record_batch_of_a_shard(tmp_path, synth):
    """One shard of several record batches: every batch is summed into the shard's report,
    not only the last one read."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "BATCH_TOKENS", 20_000)
        out = tmp_path / "out"
        pipeline.pack([str(synth[0])], str(out), PackSpec(pack_size=512, cp=2, tp=2, sp=True), shard_bytes=1 << 30)
    assert len(json.loads((out / "manifest.json").read_text())["shards"]) == 1
    with pa.ipc.open_file(str(out / "packs-00000.arrow")) as shard:
        assert shard.num_record_batches > 2
    check_against_source(inspect_output(str(out)), synth[0], out, 512, 4)


def test_pack_detail_of_a_padded_output_gives_the_pack_size(tmp_path, synth):
    """With pad_to_max_length a pack runs C positions at runtime: its detail says C, not the
    tokens stored."""
    out = pack_to(synth[0], tmp_path / "out", PackSpec(pack_size=512, cp=2, pad_to_max_length=True))
    loads = read_packs(out)["loads"]
    n = int(np.flatnonzero(loads < 512)[0])
    detail = json.loads(runner.invoke(app, ["inspect", str(out), "--pack", str(n), "--json"]).output)["pack"]
    assert detail["pack"] == n and detail["pack_len"] == 512 and sum(detail["padded_len"]) == loads[n]


def test_a_negative_pack_is_out_of_range(synth):
    """--pack -1 is no pack (not the last one, nor a row read at offset -1 of the first batch)."""
    packs = read_packs(synth[1])["loads"].size
    result = runner.invoke(app, ["inspect", str(synth[1]), "--pack", "-1"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1] == (
        f"error: --pack -1 is out of range: {synth[1]} has {packs} packs (0..{packs - 1})")


def test_a_single_output_is_reported_without_a_split_heading(synth):
    """A native output is one report: no ``split: ...`` rule above it (that heads each split of a
    Bridge layout holding several), for inspect and verify alike."""
    out = synth[1]
    for command, first in (("inspect", "packer inspect"), ("verify", "verify: OK")):
        result = runner.invoke(app, [command, str(out)], terminal_width=140)
        assert result.exit_code == 0, result.output
        assert "split:" not in result.output, result.output
        assert result.output.splitlines()[0].startswith(first), result.output


def test_reports_name_an_output_with_a_newline_in_one_line(tmp_path):
    """OUT's name went into pack's and inspect's titles and verify's verdict as it was: a newline
    in it broke the line, and a finding naming a file did the same."""
    (tmp_path / "f.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    out = tmp_path / "o\nut"
    packed = runner.invoke(app, ["pack", str(tmp_path / "f.jsonl"), "-o", str(out)])
    assert packed.exit_code == 0 and f"packer pack → {tmp_path}/o\\nut\n" in packed.output
    assert f"packer inspect → {tmp_path}/o\\nut\n" in runner.invoke(app, ["inspect", str(out)]).output
    verified = runner.invoke(app, ["verify", str(out)])
    assert verified.exit_code == 0 and verified.output.startswith(f"verify: OK: {tmp_path}/o\\nut (1 pack")
    (out / "extra\x1b[2J\n").write_text("{}")  # a finding names it
    damaged = runner.invoke(app, ["verify", str(out)])
    assert damaged.exit_code == 1 and damaged.output.splitlines()[0] == (
        "extra\\x1b[2J\\n: unexpected file, not listed in manifest.json [structure.files]")
    assert len(damaged.output.splitlines()) == 2 and "\x1b" not in damaged.output
