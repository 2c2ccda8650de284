"""The record fields packer reads besides the tokens: a padding mask (``attention_mask``) whose
padding is dropped, TRL's mask names as supervision, and the warning when several supervision
fields are present. Also the bounds of a pack size that is no multiple of m."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from conftest import packed_sequences
from packer_cli import pack
from packer_cli.cli import app
from packer_cli.errors import ConfigError
from packer_cli.shards.format import seal_metadata
from packer_cli.sources import normalize
from packer_cli.sources.normalize import Supervision, normalize_batch
from packer_cli.spec import PackSpec, SourceSpec

runner = CliRunner()


def run(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    return result


def _samples(seed: int, n: int = 60):
    """Unpadded records: ids, and labels with the prompt ignored (-100)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(1, 1000, int(rng.integers(2, 50))).tolist()
        prompt = int(rng.integers(0, len(ids)))
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def _padded(records, width: int, side: str, pad_id: int = 0):
    """HF ``padding="max_length"``: each row widened to ``width`` with an attention mask."""
    out = []
    for r in records:
        n, gap = len(r["input_ids"]), width - len(r["input_ids"])
        assert gap >= 0
        pad = lambda real, fill: real + [fill] * gap if side == "right" else [fill] * gap + real  # noqa: E731
        out.append({"input_ids": pad(r["input_ids"], pad_id), "attention_mask": pad([1] * n, 0),
                    "labels": pad(r["labels"], -100)})
    return out


def _write(path: Path, records) -> Path:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(records), path, row_group_size=17)
    else:
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


def _metadata(out: Path) -> dict:
    return json.loads((out / "metadata.json").read_text())


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_padding_is_dropped_and_packs_as_the_unpadded_records(tmp_path, side, suffix):
    records = _samples(1)
    plain = _write(tmp_path / f"plain{suffix}", records)
    padded = _write(tmp_path / f"padded{suffix}", _padded(records, 64, side))
    assert run("pack", plain, "-o", tmp_path / "a", "-C", 128).exit_code == 0
    result = run("pack", padded, "-o", tmp_path / "b", "-C", 128)
    assert result.exit_code == 0, result.output
    assert "padding dropped (attention_mask)" in result.output
    assert packed_sequences(tmp_path / "a").keys() == packed_sequences(tmp_path / "b").keys()
    for key, (inputs, labels, mask, padded_len) in packed_sequences(tmp_path / "a").items():
        got = packed_sequences(tmp_path / "b")[key]
        np.testing.assert_array_equal(got[0], inputs)
        np.testing.assert_array_equal(got[1], labels)
        np.testing.assert_array_equal(got[2], mask)
        assert got[3] == padded_len
    a, b = _metadata(tmp_path / "a"), _metadata(tmp_path / "b")
    assert a["counts"] == b["counts"]
    assert b["source"]["attention_field"] == "attention_mask"
    assert b["source"]["padding_dropped"] == sum(64 - len(r["input_ids"]) for r in records)
    assert a["source"]["attention_field"] is None and a["source"]["padding_dropped"] == 0
    assert run("verify", tmp_path / "b", "--source", padded).exit_code == 0
    # the unpadded source is not what was packed from: verify names the padding mask
    result = run("verify", tmp_path / "b", "--source", plain)
    assert result.exit_code == 1 and "padding mask" in result.output, result.output


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("mask, reason", [
    ([1, 1, 0, 1, 0], "attention_mask[2] = 0 lies between 1s"),
    ([1, 1, 2, 1, 0], "attention_mask[2] = 2 is not 0 or 1"),
    ([1, 1, 1, 0], "attention_mask has 4 values but input_ids has 5"),
])
def test_a_padding_mask_that_is_not_padding_is_a_bad_record(tmp_path, suffix, mask, reason):
    good = {"input_ids": [5, 6, 7, 8, 9], "attention_mask": [1, 1, 1, 1, 0]}
    path = _write(tmp_path / f"in{suffix}", [good, {"input_ids": [1, 2, 3, 4, 5], "attention_mask": mask}, good])
    result = run("pack", path, "-o", tmp_path / "out", "-C", 16)
    assert result.exit_code == 1 and reason in result.output and str(path) in result.output, result.output
    assert ("line 2" if suffix == ".jsonl" else "row 1") in result.output
    assert not (tmp_path / "out").exists()
    result = run("pack", path, "-o", tmp_path / "out", "-C", 16, "--on-bad-record", "skip")
    assert result.exit_code == 0, result.output
    meta = _metadata(tmp_path / "out")
    assert meta["counts"]["bad_records"] == 1 and meta["counts"]["samples_packed"] == 2
    assert meta["source"]["padding_dropped"] == 2 and meta["counts"]["runtime_tokens"] == 2 * 3


def test_an_attention_mask_named_as_the_loss_mask_is_not_also_padding(tmp_path):
    """``--mask-field attention_mask`` makes the attention mask the supervision: its 0s are the
    prompt, packed but no target. It was read as the padding mask too, and each sample's leading
    0s were dropped as padding (4 tokens packed as 2)."""
    path = _write(tmp_path / "in.jsonl", [{"input_ids": [5, 6, 7, 8], "attention_mask": [0, 0, 1, 1]}])
    result = run("pack", path, "-o", tmp_path / "out", "-C", 16, "--mask-field", "attention_mask")
    assert result.exit_code == 0, result.output
    meta = _metadata(tmp_path / "out")
    assert meta["source"]["supervision"] == {"kind": "mask", "field": "attention_mask"}
    assert (meta["source"]["attention_field"], meta["source"]["padding_dropped"]) == (None, 0)
    assert (meta["counts"]["runtime_tokens"], meta["counts"]["target_tokens"]) == (3, 2)


def test_a_sample_of_padding_only_is_too_short(tmp_path):
    path = _write(tmp_path / "in.jsonl", [{"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1]},
                                          {"input_ids": [0, 0, 0], "attention_mask": [0, 0, 0]},
                                          {"input_ids": [4, 0, 0], "attention_mask": [1, 0, 0]}])
    assert run("pack", path, "-o", tmp_path / "out", "-C", 16).exit_code == 0
    counts = _metadata(tmp_path / "out")["counts"]
    assert (counts["samples_packed"], counts["too_short_dropped"]) == (1, 2)


def test_without_an_attention_field_the_padding_is_packed(tmp_path):
    records = _padded(_samples(2, 10), 64, "right")
    path = _write(tmp_path / "in.parquet", records)
    summary = pack([str(path)], str(tmp_path / "out"), PackSpec(pack_size=128), SourceSpec(attention_field=None))
    assert summary.counts["runtime_tokens"] == 10 * 63
    assert summary.source["attention_field"] is None
    assert run("verify", tmp_path / "out", "--source", path).exit_code == 0


@pytest.mark.parametrize("side", ["right", "left"])
def test_normalize_fast_path_trims_as_the_vectorized_one(monkeypatch, side):
    records = _padded(_samples(3, 200), 60, side)
    for r in records[::9]:  # some rows whose mask holds no padding, and some all padding
        r["attention_mask"] = [1] * 60
    records[5]["attention_mask"] = [0] * 60
    batch = pa.RecordBatch.from_pylist(records)
    sup = Supervision("labels", "labels")
    kwargs = dict(path="x", row0=0, index0=0, sup=sup, spec=SourceSpec(), attention="attention_mask")
    fast = normalize._fast_batch(batch, "input_ids", sup, SourceSpec(), 0, "attention_mask")
    assert fast is not None, "a batch of padded records takes the fast path"
    monkeypatch.setattr(normalize, "_fast_batch", lambda *a: None)
    slow = normalize_batch(batch, **kwargs)
    for name in ("tokens", "targets", "lengths", "source_index"):
        np.testing.assert_array_equal(getattr(fast, name), getattr(slow, name), err_msg=name)
    assert (fast.padding, fast.too_short) == (slow.padding, slow.too_short)
    assert slow.too_short == 1


def _trl_record(ids, prompt: int, assistant_from: int):
    return {"input_ids": ids, "attention_mask": [1] * len(ids),
            "completion_mask": [0] * prompt + [1] * (len(ids) - prompt),
            "assistant_masks": [0] * assistant_from + [1] * (len(ids) - assistant_from)}


@pytest.mark.parametrize("fields, used", [
    (("completion_mask",), ("completion_mask",)),
    (("assistant_masks",), ("assistant_masks",)),
    (("completion_mask", "assistant_masks"), ("completion_mask", "assistant_masks")),  # both, as TRL
])
def test_trl_masks_are_supervision(tmp_path, fields, used):
    full = [_trl_record(list(range(1, 21)), 5, 8), _trl_record(list(range(1, 11)), 6, 3)]
    records = [{k: v for k, v in r.items() if k in ("input_ids", "attention_mask", *fields)} for r in full]
    path = _write(tmp_path / "in.parquet", records)
    result = run("pack", path, "-o", tmp_path / "out", "-C", 64)
    assert result.exit_code == 0, result.output
    meta = _metadata(tmp_path / "out")
    assert meta["source"]["supervision"] == {"kind": "mask", "field": used[0]}
    assert meta["source"]["also_mask_fields"] == list(used[1:])
    # label j is a target iff token j+1 is: a token where every mask is 1, but a sample's first
    targets = [np.logical_and.reduce([r[name] for name in used]) for r in full]
    assert meta["counts"]["target_tokens"] == sum(int(t[1:].sum()) for t in targets)
    if used[1:]:  # from token 8 of the first sample, 6 of the second: where both masks start
        assert meta["counts"]["target_tokens"] == 12 + 4
    assert "not read" not in result.output
    assert run("verify", tmp_path / "out", "--source", path).exit_code == 0


def _both_trl_masks(n: int = 40, seed: int = 3):
    """TRL's conversational prompt-completion records with ``assistant_only_loss``: a completion
    mask, and an assistant mask that leaves out parts of the completion (a turn's header)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(4, 60))
        prompt = int(rng.integers(1, length - 1))
        assistant = (rng.random(length) < 0.7).astype(int)
        out.append({"input_ids": rng.integers(1, 5000, length).tolist(),
                    "completion_mask": [0] * prompt + [1] * (length - prompt), "assistant_masks": assistant.tolist()})
    return out


def _packed_targets(out: Path) -> dict[int, list[int]]:
    """Each packed sample's loss mask (runtime: label j is trained iff token j+1 is a target), by source index."""
    return {index: mask.astype(int).tolist() for (index, _), (_, _, mask, _) in packed_sequences(out).items()}


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_both_trl_masks_apply_together_as_trl_applies_them(tmp_path, suffix):
    """A token is a target where the completion mask and the assistant mask are both 1, which
    is what TRL's trainer builds its labels from; packing the same records with each mask alone
    gives more targets."""
    records = _both_trl_masks()
    path = _write(tmp_path / f"in{suffix}", records)
    result = run("pack", path, "-o", tmp_path / "out", "-C", 128)
    assert result.exit_code == 0, result.output
    assert "loss masks 'completion_mask' and 'assistant_masks'" in " ".join(result.output.replace("│", " ").split())
    got = _packed_targets(tmp_path / "out")
    for i, r in enumerate(records):
        both = [c & a for c, a in zip(r["completion_mask"], r["assistant_masks"])]
        assert got[i] == both[1:], i
    total = sum(sum(m) for m in got.values())
    for name in ("completion_mask", "assistant_masks"):  # one mask alone trains on more
        assert run("pack", path, "-o", tmp_path / name, "-C", 128, "--mask-field", name).exit_code == 0
        assert _metadata(tmp_path / name)["counts"]["target_tokens"] > total
    forced = run("pack", path, "-o", tmp_path / "forced", "-C", 128,
                 "--mask-field", "assistant_masks", "--mask-field", "completion_mask")
    assert forced.exit_code == 0, forced.output
    assert _packed_targets(tmp_path / "forced") == got
    assert _metadata(tmp_path / "forced")["source"]["supervision"]["field"] == "assistant_masks"
    result = run("verify", tmp_path / "out", "--source", path)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_both_trl_masks_may_be_booleans(tmp_path, suffix):
    """``true``/``false`` (JSON) or ``list<bool>`` (Arrow) in either mask read as 1/0."""
    records = _both_trl_masks(12, seed=4)
    path = _write(tmp_path / f"ints{suffix}", records)
    assert run("pack", path, "-o", tmp_path / "ints", "-C", 128).exit_code == 0
    for r in records:
        r["assistant_masks"] = [bool(v) for v in r["assistant_masks"]]
        r["completion_mask"] = [bool(v) for v in r["completion_mask"]]
    path = _write(tmp_path / f"bools{suffix}", records)
    result = run("pack", path, "-o", tmp_path / "bools", "-C", 128)
    assert result.exit_code == 0, result.output
    assert _packed_targets(tmp_path / "bools") == _packed_targets(tmp_path / "ints")


def test_both_trl_masks_take_the_fast_path_and_agree_with_the_checked_one(monkeypatch):
    records = _both_trl_masks(30, seed=5)
    batch = pa.RecordBatch.from_pylist(records)
    sup = normalize.detect_supervision(batch.schema.names, SourceSpec())
    assert (sup.field, sup.also, sup.ignored) == ("completion_mask", ("assistant_masks",), ())
    fast = normalize._fast_batch(batch, "input_ids", sup, SourceSpec(), 0)
    assert fast is not None, "records with both masks take the fast path"
    monkeypatch.setattr(normalize, "_fast_batch", lambda *a: None)
    slow = normalize_batch(batch, path="x", row0=0, index0=0, sup=sup, spec=SourceSpec())
    for name in ("tokens", "targets", "lengths", "source_index"):
        np.testing.assert_array_equal(getattr(fast, name), getattr(slow, name), err_msg=name)
    both = np.concatenate([np.array(r["completion_mask"]) & np.array(r["assistant_masks"]) for r in records])
    np.testing.assert_array_equal(fast.targets, both)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("fault, reason", [
    (lambda r: r.update(assistant_masks=r["assistant_masks"][:-1]), "assistant_masks has {n1} values but input_ids has {n}"),
    (lambda r: r["assistant_masks"].__setitem__(2, 2), "assistant_masks[2] = 2 is not 0 or 1"),
    (lambda r: r.update(assistant_masks=None), "field 'assistant_masks' is null"),
    (lambda r: r["completion_mask"].__setitem__(1, 7), "completion_mask[1] = 7 is not 0 or 1"),
])
def test_a_bad_second_mask_is_a_bad_record_named_by_its_field(tmp_path, suffix, fault, reason):
    records = _both_trl_masks(10, seed=7)
    fault(records[4])
    path = _write(tmp_path / f"in{suffix}", records)
    result = run("pack", path, "-o", tmp_path / "out", "-C", 128)
    assert result.exit_code != 0
    n = len(records[4]["input_ids"])
    where = "line 5" if suffix == ".jsonl" else "row 4"
    assert f"{where}: {reason.format(n=n, n1=n - 1)}" in result.output, result.output
    assert not (tmp_path / "out").exists()
    skipped = run("pack", path, "-o", tmp_path / "skip", "-C", 128, "--on-bad-record", "skip")
    assert skipped.exit_code == 0, skipped.output
    assert sorted(_packed_targets(tmp_path / "skip")) == [i for i in range(10) if i != 4]


def test_a_loss_mask_outranks_both_trl_masks_and_labels_do_not_join_them(tmp_path):
    records = _both_trl_masks(6, seed=2)
    for r in records:
        r["labels"] = r["input_ids"]  # every token, were it read
    path = _write(tmp_path / "in.jsonl", records)
    result = run("pack", path, "-o", tmp_path / "out", "-C", 128)
    assert result.exit_code == 0, result.output
    assert "the records' 'labels' was not read" in result.output
    assert _metadata(tmp_path / "out")["source"]["also_mask_fields"] == ["assistant_masks"]
    for r in records:
        r["loss_mask"] = [1] * len(r["input_ids"])
    path = _write(tmp_path / "with_loss_mask.jsonl", records)
    result = run("pack", path, "-o", tmp_path / "lm", "-C", 128)
    assert result.exit_code == 0, result.output
    assert "the records' 'completion_mask', 'assistant_masks', 'labels' were not read" in result.output
    meta = _metadata(tmp_path / "lm")
    assert (meta["source"]["supervision"]["field"], meta["source"]["also_mask_fields"]) == ("loss_mask", [])
    assert meta["counts"]["target_tokens"] == sum(len(r["input_ids"]) - 1 for r in records)


def test_an_output_that_applied_one_trl_mask_verifies_so_and_a_changed_record_is_found(tmp_path):
    """An output of a packer that read one TRL mask records no ``also_mask_fields``: its source
    is replayed with that mask alone and verifies. Recording the wrong masks is found."""
    records = _both_trl_masks(12, seed=9)
    path = _write(tmp_path / "in.parquet", records)
    assert run("pack", path, "-o", tmp_path / "one", "-C", 128, "--mask-field", "completion_mask").exit_code == 0
    doc = _metadata(tmp_path / "one")
    assert doc["source"]["also_mask_fields"] == []
    del doc["source"]["also_mask_fields"], doc["checksum"]
    (tmp_path / "one" / "metadata.json").write_text(json.dumps(seal_metadata(dict(doc))))
    result = run("verify", tmp_path / "one", "--source", path)
    assert result.exit_code == 0, result.output
    doc["source"]["also_mask_fields"] = ["assistant_masks"]  # masks the output's targets were not built with
    (tmp_path / "one" / "metadata.json").write_text(json.dumps(seal_metadata(dict(doc))))
    result = run("verify", tmp_path / "one", "--source", path)
    assert result.exit_code == 1
    assert "is 1 but the source" in result.output and "(source.targets)" in result.output, result.output
    for wrong in ("assistant_masks", [""], [3]):
        doc["source"]["also_mask_fields"] = wrong
        (tmp_path / "one" / "metadata.json").write_text(json.dumps(seal_metadata(dict(doc))))
        result = run("verify", tmp_path / "one")
        assert result.exit_code == 1 and "source.also_mask_fields" in result.output, (wrong, result.output)


@pytest.mark.parametrize("kwargs, message", [
    (dict(also_mask_fields=("assistant_masks",)), "also-mask-fields needs a mask-field to apply them with"),
    (dict(mask_field="m", also_mask_fields="assistant_masks"), "also-mask-fields must be a list of field names"),
    (dict(mask_field="m", also_mask_fields=("a", "")), "also-mask-fields must be field names (UTF-8 text), got ''"),
    (dict(mask_field="m", also_mask_fields=("a", "m")), "mask field 'm' is named twice"),
    (dict(mask_field="m", also_mask_fields=("a", "a")), "mask field 'a' is named twice"),
])
def test_also_mask_fields_are_checked(kwargs, message):
    with pytest.raises(ConfigError) as err:
        SourceSpec(**kwargs).validate()
    assert message in str(err.value)
    assert SourceSpec(mask_field="m", also_mask_fields=["a"]).validate().also_mask_fields == ("a",)


def test_all_targets_reads_no_supervision_field(tmp_path):
    """``--all-targets`` trains on every token whatever supervision the records carry (TRL's
    ``completion_only_loss=False``), and ``verify --source`` replays it so."""
    records = _both_trl_masks(15, seed=6)
    for r in records:
        r["labels"] = [-100] * len(r["input_ids"])
    path = _write(tmp_path / "in.parquet", records)
    result = run("pack", path, "-o", tmp_path / "out", "-C", 128, "--all-targets")
    assert result.exit_code == 0, result.output
    assert "not read" not in result.output
    meta = _metadata(tmp_path / "out")
    assert meta["source"]["supervision"] == {"kind": "all", "field": None}
    assert meta["counts"]["target_tokens"] == sum(len(r["input_ids"]) - 1 for r in records)
    assert all(all(m) for m in _packed_targets(tmp_path / "out").values())
    assert run("verify", tmp_path / "out", "--source", path).exit_code == 0
    for option in ("--mask-field", "--labels-field"):
        result = run("pack", path, "-o", tmp_path / "x", "-C", 128, "--all-targets", option, "labels")
        assert result.exit_code != 0 and not (tmp_path / "x").exists()
        assert "--all-targets excludes --mask-field and --labels-field" in result.output, result.output


def test_a_second_mask_that_is_the_tokens_field_is_refused(tmp_path):
    path = _write(tmp_path / "in.jsonl", _both_trl_masks(3))
    result = run("pack", path, "-o", tmp_path / "out", "-C", 128, "--mask-field", "completion_mask",
                 "--mask-field", "input_ids")
    assert result.exit_code != 0
    assert "field 'input_ids' is the tokens field (--tokens-field) and cannot also be the mask field" in result.output


def test_loss_mask_outranks_labels_with_a_warning(tmp_path):
    path = _write(tmp_path / "in.jsonl", [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1],
                                           "labels": [-100, 2, 3, 4]}])
    result = run("pack", path, "-o", tmp_path / "out", "-C", 16)
    assert result.exit_code == 0
    assert "targets come from 'loss_mask'; the records' 'labels' was not read" in result.output
    assert _metadata(tmp_path / "out")["counts"]["target_tokens"] == 2


def test_bounds_count_only_the_capacity_padded_sequences_can_fill(tmp_path):
    path = _write(tmp_path / "in.jsonl", _samples(4, 80))
    result = run("pack", path, "-o", tmp_path / "out", "-C", 100, "--cp", 2, "--tp", 4, "--sp", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert "not a multiple of the padding multiple 8" in result.stderr
    quality, counts = summary["quality"], summary["counts"]
    assert quality["lower_bound"] == -(-counts["padded_tokens"] // 96)
    assert run("pack", path, "-o", tmp_path / "o96", "-C", 96, "--cp", 2, "--tp", 4, "--sp").exit_code == 0
    assert _metadata(tmp_path / "o96")["quality"]["l2_bound"] == quality["l2_bound"]
    assert run("verify", tmp_path / "out").exit_code == 0
    # an output that recorded the whole pack size's bounds, as packer did before, still verifies
    doc = _metadata(tmp_path / "out")
    doc["quality"]["lower_bound"] = -(-counts["padded_tokens"] // 100)
    doc["quality"]["gap_to_lower_bound"] = counts["packs"] - doc["quality"]["lower_bound"]
    doc["quality"]["gap_to_lower_bound_pct"] = 100.0 * doc["quality"]["gap_to_lower_bound"] / doc["quality"]["lower_bound"]
    doc.pop("checksum")
    (tmp_path / "out" / "metadata.json").write_text(json.dumps(seal_metadata(dict(doc))))
    assert doc["quality"]["lower_bound"] != quality["lower_bound"]
    assert run("verify", tmp_path / "out").exit_code == 0
    doc["quality"]["lower_bound"] += 5  # neither figure
    (tmp_path / "out" / "metadata.json").write_text(json.dumps(seal_metadata(dict(doc))))
    result = run("verify", tmp_path / "out")
    assert result.exit_code == 1 and "quality.lower_bound" in result.output


@pytest.mark.parametrize("make, named", [
    (lambda: pa.table({"input_ids": [[1, 2, 3]]}), "pyarrow.lib.Table"),
    (lambda: {"a.jsonl"}, "set"),
    (lambda: 3, "int"),
])
def test_in_memory_data_as_inputs_is_named_by_its_type(tmp_path, make, named):
    with pytest.raises(ConfigError) as err:
        pack(make(), str(tmp_path / "out"), PackSpec(pack_size=64))
    assert named in str(err.value) and len(str(err.value)) < 300


def test_a_generator_of_paths_is_accepted(tmp_path):
    _write(tmp_path / "a.jsonl", _samples(5, 5))
    summary = pack((p for p in [tmp_path / "a.jsonl"]), str(tmp_path / "out"), PackSpec(pack_size=64))
    assert summary.counts["records"] == 5


@pytest.mark.parametrize("skip_one", [False, True])  # a bad record in the batch: the vectorized path
def test_padding_ids_are_not_checked_against_the_vocabulary(tmp_path, skip_one):
    """A [PAD] id added past the base vocabulary is dropped with the padding, never packed."""
    records = [{"input_ids": [1, 2, 3, 32000, 32000], "attention_mask": [1, 1, 1, 0, 0]},
               {"input_ids": [-1, 4, 5, 6], "attention_mask": [0, 1, 1, 1]}]
    if skip_one:
        records.append({"input_ids": [7, 32001, 8], "attention_mask": [1, 1, 1]})
    path = _write(tmp_path / "in.jsonl", records)
    args = ["--on-bad-record", "skip"] if skip_one else []
    result = run("pack", path, "-o", tmp_path / "out", "-C", 16, "--vocab-size", 32000, *args)
    assert result.exit_code == 0, result.output
    meta = _metadata(tmp_path / "out")
    assert (meta["counts"]["samples_packed"], meta["counts"]["bad_records"]) == (2, int(skip_one))
    assert meta["source"]["padding_dropped"] == 3
    if skip_one:
        assert "input_ids[1] = 32001 is >= vocab size 32000" in meta["bad_records"][0]["reason"]
    assert run("verify", tmp_path / "out", "--source", path).exit_code == 0


def test_an_output_recorded_as_every_token_replays_so(tmp_path):
    """An output a packer that knew no TRL mask names packed as "every token is a target" is
    verified against its source so, not by what this packer would detect in it."""
    records = [_trl_record(list(range(1, 21)), 5, 8)]
    path = _write(tmp_path / "in.parquet", [{k: r[k] for k in ("input_ids", "completion_mask")} for r in records])
    summary = pack([str(path)], str(tmp_path / "out"), PackSpec(pack_size=64), SourceSpec(all_targets=True))
    assert summary.source["supervision"] == {"kind": "all", "field": None}
    assert summary.counts["target_tokens"] == 19
    result = run("verify", tmp_path / "out", "--source", path)
    assert result.exit_code == 0, result.output
    with pytest.raises(ConfigError, match="--all-targets excludes --mask-field and --labels-field"):
        SourceSpec(all_targets=True, mask_field="loss_mask").validate()


def test_the_bound_row_names_the_capacity_it_counts(tmp_path):
    path = _write(tmp_path / "in.jsonl", _samples(6, 30))
    result = run("pack", path, "-o", tmp_path / "out", "-C", 100, "--pad-seq-to-mult", 8)
    assert "⌈Σp/C′⌉ (C′ = 96)" in result.output, result.output
    assert "⌈Σp/C′⌉ (C′ = 96)" in run("inspect", tmp_path / "out").output
    result = run("pack", path, "-o", tmp_path / "o2", "-C", 96, "--pad-seq-to-mult", 8)
    assert "⌈Σp/C⌉" in result.output and "C′" not in result.output
