"""`verify` and `inspect` on outputs damaged by mutation: hostile JSON values, byte flips and
truncations, files swapped in from elsewhere, and shards rewritten with consistent checksums.

Each case breaks a copy of a small good output (native, several shards; Megatron-Bridge, both
splits). Neither command may crash with a traceback; verify must fail (exit 1) naming the
problem, inspect must report correctly or fail with one line, and ``--json`` must print one
JSON document.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from packer_cli.shards.format import seal_metadata

from damage import make_outputs, run

C = 512


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_outputs(tmp_path_factory.mktemp("mutations"), C, (120, 40), max_len=700, batch_tokens=8_000)


def metadata_name(kind: str) -> str:
    return "metadata.json" if kind == "native" else "training.metadata.json"


def edit_metadata(out: Path, name: str, edit, seal: bool = True) -> None:
    """Apply ``edit(doc)`` to a metadata file; with ``seal`` its checksum is made to hold again,
    so only the schema and data checks can see the edit."""
    doc = json.loads((out / name).read_text())
    edit(doc)
    if seal:
        doc.pop("checksum", None)
        doc = seal_metadata(doc)
    (out / name).write_text(json.dumps(doc))


def assert_refused(out: Path, says: str, split: str | None = None) -> None:
    """verify exits 1 naming ``says``; inspect exits 1 with one line; both --json give a document."""
    pick = ["--split", split] if split else []
    result = run("verify", out, *pick)
    assert result.exit_code == 1 and says in result.output, result.output
    for args in (["verify", out, "--json", *pick], ["inspect", out, "--json", *pick]):
        result = run(*args)
        assert result.exit_code == 1, result.output
        assert json.loads(result.stdout)["ok"] is False
    result = run("inspect", out, *pick)
    assert result.exit_code == 1 and result.output.startswith("error: ") and says in result.output, result.output


# --- hostile JSON values -------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["native", "bridge"])
@pytest.mark.parametrize("seal", [True, False])
def test_json_nested_deeper_than_it_can_be_written_is_a_finding(copy, kind, seal):
    """orjson reads 1,024 levels but writes 254: the metadata checksum raised on a value in
    between (TypeError: Recursion limit reached) instead of reporting the file."""
    out = copy(kind)
    name = metadata_name(kind)
    text = (out / name).read_text()
    doc = json.loads(text)
    if seal:
        doc = seal_metadata({k: v for k, v in doc.items() if k != "checksum"})
    nested = "[" * 300 + "]" * 300
    (out / name).write_text(json.dumps({**doc, "junk": "@"}).replace('"@"', nested))
    assert_refused(out, name, "training" if kind == "bridge" else None)


@pytest.mark.parametrize("kind", ["native", "bridge"])
@pytest.mark.parametrize("path", [("format",), ("source", "on_bad_record")])
@pytest.mark.parametrize("value", [[], {}, [1], {"a": 1}])
def test_unhashable_values_where_a_name_belongs_are_findings(copy, kind, path, value):
    """A list or object as the format name or the bad-record policy was looked up in a dict or a
    set: TypeError: unhashable type."""
    out = copy(kind)

    def edit(doc):
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    edit_metadata(out, metadata_name(kind), edit)
    if kind == "bridge" and path == ("format",):  # no longer a Bridge split's metadata: not opened
        assert_refused(out, "is not packer's 'megatron-bridge' metadata", "training")
    elif path == ("format",):
        assert_refused(out, "structure.format")
    else:
        assert_refused(out, f"{'.'.join(path)} has an unexpected value", "training" if kind == "bridge" else None)


def test_open_store_refuses_an_unhashable_format_by_name(copy):
    from packer_cli.audit import open_store
    from packer_cli.errors import DataError

    out = copy("native")
    edit_metadata(out, "metadata.json", lambda doc: doc.update(format=["packer-thd"]))
    with pytest.raises(DataError, match="unsupported data format"):
        open_store(str(out))


@pytest.mark.parametrize("edit, says", [
    (lambda doc: doc.update(format_version=True), "version True"),
    (lambda doc: doc["output"].update(eos_id="2"), "output.eos_id has an unexpected value '2'"),
    (lambda doc: doc["output"].update(eos_id=2.0), "output.eos_id has an unexpected value 2.0"),
    (lambda doc: doc["output"].pop("eos_id"), "output.eos_id is missing"),
    (lambda doc: doc.pop("output"), "output is NoneType, expected an object"),
    (lambda doc: doc.update(split=["training"]), "metadata.split has an unexpected value"),
    (lambda doc: doc.pop("split"), "metadata.split is missing"),
])
def test_a_bridge_split_metadata_with_its_own_fields_mistyped_is_a_finding(copy, edit, says):
    """A Bridge split's ``output.eos_id`` (what the stored padding is checked against) and
    ``split`` were never type-checked, and ``format_version: true`` was read as version 1: with
    the checksum recomputed, verify said OK."""
    out = copy("bridge")
    edit_metadata(out, "training.metadata.json", edit)
    assert_refused(out, says, "training")


@pytest.mark.parametrize("kind", ["native", "bridge"])
@pytest.mark.parametrize("value", [None, 1, [], {}, ""])
def test_quality_plan_must_be_a_name(copy, kind, value):
    out = copy(kind)
    edit_metadata(out, metadata_name(kind), lambda doc: doc["quality"].update(plan=value))
    assert_refused(out, "quality.plan has an unexpected value", "training" if kind == "bridge" else None)


@pytest.mark.parametrize("kind", ["native", "bridge"])
@pytest.mark.parametrize("name", [[], {"a": 1}])
def test_a_shard_entry_named_by_a_list_or_object_is_a_finding(copy, kind, name):
    """The duplicate-name check put every entry's name in a set, usable or not: unhashable type."""
    out = copy(kind)
    manifest = out / ("manifest.json" if kind == "native" else "training.manifest.json")
    doc = json.loads(manifest.read_text())
    doc["shards"][0]["name"] = name
    manifest.write_text(json.dumps(doc))
    assert_refused(out, "has an unusable name", "training" if kind == "bridge" else None)


@pytest.mark.parametrize("gone, left", [("validation", "training"), ("training", "validation")])
@pytest.mark.parametrize("how", ["deleted", "a directory"])
def test_a_bridge_split_that_lost_its_metadata_is_not_skipped(copy, gone, left, how):
    """A split is found by its metadata file alone: without it, its data and manifest looked like
    a split Bridge wrote itself, and verify said OK over every split, even with the data damaged."""
    out = copy("bridge")
    (out / f"{gone}.metadata.json").unlink()
    if how == "a directory":
        (out / f"{gone}.metadata.json").mkdir()
    data = out / f"{gone}_{C}.idx.parquet"
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    data.write_bytes(bytes(damaged))
    what = "missing" if how == "deleted" else "not a regular file"  # one message, whichever split is read
    for pick in ([], ["--split", left]):
        result = run("verify", out, *pick)
        assert result.exit_code == 1, result.output
        assert f"{gone}.metadata.json: {what}, but {gone}.manifest.json is here" in result.output
    result = run("inspect", out)
    assert result.exit_code == 1 and f"{gone}.metadata.json: {what}" in result.output


@pytest.mark.parametrize("how", ["deleted", "a directory"])
def test_the_only_bridge_split_that_lost_its_metadata_is_damage(copy, how):
    """With no split's metadata left the layout was 'not a packer output' (exit 2), though its
    manifest says packer wrote it: the same structure.json finding as beside another split."""
    out = copy("bridge")
    for name in ("validation.metadata.json", "validation.manifest.json", f"validation_{C}.idx.parquet"):
        (out / name).unlink()
    (out / "training.metadata.json").unlink()
    if how == "a directory":
        (out / "training.metadata.json").mkdir()
    what = "missing" if how == "deleted" else "not a regular file"
    for args in (["verify", out], ["verify", out, "--split", "training"], ["inspect", out]):
        result = run(*args)
        assert result.exit_code == 1, result.output
        assert f"training.metadata.json: {what}, but training.manifest.json is here" in result.output, result.output
    assert "[structure.json]" in run("verify", out).output
    pytest.importorskip("torch")
    from packer_cli.errors import DataError
    from packer_cli.torch import PackedDataset

    with pytest.raises(DataError, match=f"training.metadata.json: {what}, but training.manifest.json"):
        PackedDataset(str(out))


@pytest.mark.parametrize("kind", ["native", "bridge"])
@pytest.mark.parametrize("edit", [
    lambda source: source["inputs"][0].update(bytes=None),
    lambda source: source["inputs"][0].update(bytes="234583"),
    lambda source: source["inputs"][0].update(bytes=[]),
    lambda source: source.update(inputs=5),
    lambda source: source.update(inputs=["train.parquet"]),
])
def test_verify_source_with_mistyped_recorded_inputs(copy, made, kind, edit):
    """The input-size warning formatted the recorded size with ``:,`` (a TypeError or ValueError
    for None, a string or a list) and took len() of whatever ``inputs`` was."""
    out = copy(kind)
    edit_metadata(out, metadata_name(kind), lambda doc: edit(doc["source"]))
    pick = ["--split", "training"] if kind == "bridge" else []
    result = run("verify", out, "--source", made["train"], *pick)
    assert result.exit_code == 1 and "[metadata.schema]" in result.output, result.output
    result = run("verify", out, "--source", made["train"], "--json", *pick)
    assert json.loads(result.stdout)["errors"]["metadata.schema"] >= 1


@pytest.mark.parametrize("pad_id", [2**31, 2**64 - 1])
def test_a_bridge_pad_id_beyond_int32_is_a_data_error_when_read(copy, pad_id):
    """Rebuilding native rows wrote spec.pad_id into the int32 tokens: OverflowError from NumPy
    through open_store().read_shard (verify itself skips the packs: metadata.spec)."""
    from packer_cli.audit import open_store
    from packer_cli.errors import DataError

    out = copy("bridge")
    edit_metadata(out, "training.metadata.json", lambda doc: doc["spec"].update(pad_id=pad_id))
    store = open_store(str(out))
    with pytest.raises(DataError, match="spec.pad_id"):
        for name in store.shard_names():
            list(store.read_shard(name))
    assert_refused(out, "pad-id must be a non-negative int32", "training")


# --- column names that are not UTF-8 ---------------------------------------------------------

def flip_name_bit(data: Path, column: bytes) -> None:
    """Flip the high bit of ``column``'s last letter where the schema in the file's footer (Arrow
    IPC or Parquet) names it first, so the name is no longer UTF-8. pyarrow decodes a name only
    when asked for it (a Parquet file's, as it opens the file)."""
    raw = bytearray(data.read_bytes())
    tail = 8 if raw.endswith(b"PAR1") else 10  # the footer's length, then PAR1 or ARROW1
    footer = len(raw) - tail - int.from_bytes(raw[-tail:4 - tail], "little")
    raw[raw.index(column, footer) + len(column) - 1] ^= 0x80
    data.write_bytes(bytes(raw))


@pytest.mark.parametrize("kind,data,column,says", [
    ("native", "packs-00000.arrow", b"source_offset",
     "schema differs from the packer-thd version 2 pack schema: column 6's name b'source_offse\\xf4' is not "
     "valid UTF-8"),
    ("bridge", f"training_{C}.idx.parquet", b"packer_source_index",
     "cannot open as Parquet (a column name in its footer, b'packer_source_inde\\xf8', is not valid UTF-8)"),
])
def test_a_column_name_that_is_not_utf8_is_a_finding(copy, kind, data, column, says):
    """The schema check (native) or pyarrow opening the footer (Bridge) decoded the name and
    raised UnicodeDecodeError: a traceback from inspect, no document from inspect --json, and
    verify's vague 'could not be checked after row 0'."""
    out = copy(kind)
    flip_name_bit(out / data, column)
    split = "training" if kind == "bridge" else None
    assert_refused(out, f"{data}: {says}", split)
    pick = ["--split", split] if split else []
    assert f"{data}: {says} [shard.unreadable]" in run("verify", out, *pick).output
    result = run("inspect", out, *pick)
    # named within its output (every output has a packs-00000.arrow), pointing at verify
    said = f"{out}: {data}: {says}; run `packer verify` for a full report"
    assert result.output.strip() == f"error: {said}", result.output
    assert json.loads(run("inspect", out, "--json", *pick).stdout)["error"] == said


def set_group_rows(data: Path, group: int, rows: int) -> None:
    """Rewrite a Parquet file's footer with row group ``group`` claiming ``rows`` rows."""
    from packer_cli._thrift import write_fields
    from packer_cli.shards._parquet_stitch import MAGIC, _parse

    view, start, footer = _parse(data.read_bytes())
    kind, groups = next(value for fid, _, value in footer if fid == 4)
    groups[group] = [(fid, k, rows if fid == 3 else value) for fid, k, value in groups[group]]
    out = bytearray()
    write_fields(out, footer)
    data.write_bytes(bytes(view[:start]) + bytes(out) + len(out).to_bytes(4, "little") + MAGIC)


@pytest.mark.parametrize("rows", [-9, 0], ids=["negative", "short"])
def test_a_bridge_footers_damaged_row_count_is_refused(copy, rows):
    """A row group claiming -9 rows (or none) in the footer of a Bridge split: packer's decoder
    sized its arrays by that count (a negative one corrupted the heap), and inspect summarized
    the packs the counts pointed at (4 of 21) as a healthy output. Now the file is refused where
    it is opened: verify's finding, inspect's error, the loader's DataError."""
    from packer_cli.errors import DataError
    from packer_cli.shards.reader import PackedReader

    out = copy("bridge")
    data = out / f"training_{C}.idx.parquet"
    set_group_rows(data, 0, rows)
    manifest = out / "training.manifest.json"  # its recorded size follows the footer (no shard.size)
    record = json.loads(manifest.read_text())
    record["shards"][0]["bytes"] = data.stat().st_size
    manifest.write_text(json.dumps(record))
    says = "row groups hold"
    assert_refused(out, says, "training")
    assert "(a damaged footer) [shard.unreadable]" in run("verify", out, "--split", "training").output
    with pytest.raises(DataError, match=f"{data.name}: its footer's row groups hold .* rows, not .* in all"):
        PackedReader(str(out), split="training")


def test_bridge_schema_check_names_a_column_name_that_is_not_utf8():
    """``schema_problem`` asked the schema for its names first (UnicodeDecodeError), should the
    Parquet file open with its Arrow schema's names damaged."""
    import pyarrow as pa

    from packer_cli.shards.bridge_reader import schema_problem
    from packer_cli.shards.bridge_writer import BRIDGE_SCHEMA

    raw = bytearray(BRIDGE_SCHEMA.serialize().to_pybytes())
    raw[raw.index(b"seq_start_id") + 11] ^= 0x80
    damaged = pa.ipc.read_schema(pa.py_buffer(bytes(raw)))
    assert schema_problem(damaged) == ("schema differs from the megatron-bridge version 1 schema: column 2's name "
                                       "b'seq_start_i\\xe4' is not valid UTF-8")


@pytest.mark.parametrize("key", ["split", "output.split"])
def test_a_bridge_split_whose_metadata_names_another_split_is_refused(copy, key):
    """AUDIT.md: a split's metadata's split name is checked. Only the manifest's was: a metadata
    file naming the validation split in the training split's place, resealed, passed."""
    out = copy("bridge")

    def rename(doc):
        (doc if key == "split" else doc["output"])["split"] = "validation"

    edit_metadata(out, "training.metadata.json", rename)
    assert_refused(out, f"training.metadata.json: {key} is 'validation', but the file is the training split's",
                   "training")


@pytest.mark.parametrize("edit, says", [
    ({"split": "validation"}, "training.manifest.json: split is 'validation', but the file is the training split's"),
    ({"format_version": 2}, "training.manifest.json: format_version is 2; this packer reads version 1"),
], ids=["split", "version"])
def test_a_bridge_split_manifest_of_another_split_or_version_is_refused(copy, edit, says):
    """A split's manifest is checked as its metadata is: one naming another split (copied into
    this one's place) or a later format version is refused by verify, inspect and a reader that
    skips the layout checks (a DataLoader worker's)."""
    from packer_cli.errors import DataError
    from packer_cli.shards.reader import PackedReader

    out = copy("bridge")
    manifest = out / "training.manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), **edit}))
    assert_refused(out, says, "training")
    with pytest.raises(DataError, match=re.escape(says)):
        PackedReader(out, "training", check=False)


def test_a_mistyped_recorded_eos_id_leaves_the_packs_checked(copy):
    """``output.eos_id: true`` is a metadata.schema finding; the split file's own eos_id is not
    compared with it (True == 1 in Python), so its packs are still read and checked."""
    out = copy("bridge")
    edit_metadata(out, "training.metadata.json", lambda doc: doc["output"].update(eos_id=True))
    result = run("verify", out, "--split", "training", "--json")
    assert result.exit_code == 1, result.output
    checks = {finding["check"] for finding in json.loads(result.stdout)["findings"]}
    assert checks == {"metadata.schema"}, result.stdout


# --- over-long counts the policy rules out ---------------------------------------------------

@pytest.fixture(scope="module")
def overlong_outputs(made, tmp_path_factory):
    """Native outputs of the training input (samples up to 700 tokens) at C=512 under split and truncate."""
    root = tmp_path_factory.mktemp("overlong")
    outs = {}
    for policy in ("split", "truncate"):
        result = run("pack", made["train"], "-o", root / policy, "-C", C, "--overlong", policy)
        assert result.exit_code == 0, result.output
        outs[policy] = root / policy
    return outs


LOST_EDITS = [  # (policy, changes to counts.overlong): each contradicts what the policy allows
    ("split", {"target_tokens_lost": 1}),
    ("truncate", {"target_tokens_lost": "lost + 1"}),
    ("truncate", {"samples": 0}),
    ("truncate", {"tokens_lost": 0, "target_tokens_lost": 0}),
    ("truncate", {"tokens_lost": "samples - 1", "target_tokens_lost": 0}),
]


@pytest.mark.parametrize("policy,changes", LOST_EDITS)
def test_overlong_counts_the_policy_rules_out_are_findings(overlong_outputs, tmp_path, policy, changes):
    """Such counts (the metadata re-sealed) passed verify without --source: split's lost
    targets, and truncate's lost tokens against its truncated samples, were not compared."""
    import shutil
    out = Path(shutil.copytree(overlong_outputs[policy], tmp_path / policy))
    over = json.loads((out / "metadata.json").read_text())["counts"]["overlong"]
    assert run("verify", out).exit_code == 0
    if policy == "truncate":
        assert over["samples"] > 1 and over["tokens_lost"] > over["samples"]
    values = {"lost + 1": over["tokens_lost"] + 1, "samples - 1": over["samples"] - 1}

    def edit(doc):
        for key, value in changes.items():
            doc["counts"]["overlong"][key] = values.get(value, value)

    edit_metadata(out, "metadata.json", edit)
    result = run("verify", out)
    assert result.exit_code == 1 and "[metadata.counts]" in result.output, result.output


# --- a Bridge split's recorded file facts ------------------------------------------------------

FILE_FACTS = [  # (file, changes): the manifest's entry, or the metadata's output record (re-sealed)
    ("manifest", {"row_groups": 99}),
    ("manifest", {"row_group_size": 3, "row_groups": 99}),
    ("manifest", {"parquet_encoding": "split-zstd"}),
    ("manifest", {"parquet_encoding": "plain-snappy"}),
    ("manifest", {"stored_tokens": {}}),
    ("manifest", {"stored_tokens": 5}),
    ("metadata", {"parquet_encoding": "plain-snappy"}),
    ("metadata", {"row_group_size": []}),
    ("metadata", {"files": {"data": "other.parquet"}}),
    ("metadata", {"format": "x"}),
    ("metadata", {"eos_scan_too_short": -1}),
    ("metadata", {"eos_id_source": "guessed"}),
    ("metadata", {"eos_id_source": "inferred", "samples_not_ending_with_eos": 3}),
]


@pytest.mark.parametrize("where,changes", FILE_FACTS, ids=[f"{w}-{'-'.join(c)}" for w, c in FILE_FACTS])
def test_a_bridge_splits_recorded_file_facts_must_hold(copy, where, changes):
    """What the manifest entry and the metadata's output record say about the split's file
    (encoding, row groups, stored tokens, names) was never looked at: any value, of any type,
    passed verify."""
    out = copy("bridge")
    if where == "manifest":
        path = out / "training.manifest.json"
        doc = json.loads(path.read_text())
        doc["shards"][0].update(changes)
        path.write_text(json.dumps(doc))
    else:
        edit_metadata(out, "training.metadata.json", lambda doc: doc["output"].update(changes))
    result = run("verify", out, "--split", "training")
    assert result.exit_code == 1 and "[bridge.file]" in result.output, result.output


def test_a_recorded_file_fact_of_another_type_is_a_finding(copy):
    """The output record's row_group_size as a float (equal in value to the manifest's integer)
    is not what packer writes: named, with the manifest's value."""
    out = copy("bridge")
    size = json.loads((out / "training.manifest.json").read_text())["shards"][0]["row_group_size"]
    edit_metadata(out, "training.metadata.json", lambda doc: doc["output"].update(row_group_size=float(size)))
    result = run("verify", out, "--split", "training")
    assert result.exit_code == 1
    assert (f"training.metadata.json: output.row_group_size is {float(size)}, the manifest's is {size} "
            f"[bridge.file]") in result.output, result.output


def test_a_recorded_file_fact_the_footer_contradicts_names_the_manifest(copy):
    """A stored token count the file's footer does not give is the manifest entry's fault: the
    finding names the manifest, not the data file."""
    out = copy("bridge")
    path = out / "training.manifest.json"
    doc = json.loads(path.read_text())
    true = doc["shards"][0]["stored_tokens"]
    doc["shards"][0]["stored_tokens"] = true + 1
    path.write_text(json.dumps(doc))
    result = run("verify", out, "--split", "training")
    assert result.exit_code == 1
    assert (f"training.manifest.json: stored_tokens is {true + 1}, the file's input_ids hold {true} values "
            f"[bridge.file]") in result.output, result.output

@pytest.mark.parametrize("key", ["format", "split", "files", "row_group_size"])
def test_a_bridge_output_record_missing_a_key_is_a_finding(copy, key):
    """A missing key of the output record raised KeyError (a traceback from verify and inspect)."""
    out = copy("bridge")
    edit_metadata(out, "training.metadata.json", lambda doc: doc["output"].pop(key))
    assert_refused(out, f"output.{key} is missing", "training")


@pytest.mark.parametrize("where", ["manifest", "metadata"])
def test_a_parquet_encoding_missing_from_one_record_only_is_a_finding(copy, where):
    """Every packer wrote it in both records or in neither: missing from one is an edit, and passed."""
    out = copy("bridge")
    if where == "manifest":
        path = out / "training.manifest.json"
        doc = json.loads(path.read_text())
        del doc["shards"][0]["parquet_encoding"]
        path.write_text(json.dumps(doc))
    else:
        edit_metadata(out, "training.metadata.json", lambda meta: meta["output"].pop("parquet_encoding"))
    result = run("verify", out, "--split", "training")
    assert result.exit_code == 1 and "output.parquet_encoding" in result.output, result.output


def test_a_bridge_split_recorded_before_its_encoding_verifies(copy):
    """A split written before packer recorded its Parquet encoding has no such key."""
    out = copy("bridge")
    path = out / "training.manifest.json"
    doc = json.loads(path.read_text())
    del doc["shards"][0]["parquet_encoding"]
    path.write_text(json.dumps(doc))
    edit_metadata(out, "training.metadata.json", lambda meta: meta["output"].pop("parquet_encoding"))
    result = run("verify", out, "--split", "training")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("key", ["row_group_size", "row_groups", "stored_tokens"])
def test_a_bridge_manifest_without_a_fact_every_packer_wrote_is_a_finding(copy, key):
    """Deleting row_group_size switched the footer comparison off, so a wrong stored_tokens beside
    it passed: every packer that wrote the layout recorded these three."""
    out = copy("bridge")
    path = out / "training.manifest.json"
    doc = json.loads(path.read_text())
    del doc["shards"][0][key]
    doc["shards"][0]["stored_tokens" if key != "stored_tokens" else "row_groups"] += 1000
    path.write_text(json.dumps(doc))
    result = run("verify", out, "--split", "training")
    assert result.exit_code == 1 and f"{key} is None" in result.output, result.output
    assert "the file's input_ids hold" in result.output or "the file has" in result.output, result.output


@pytest.mark.parametrize("kind", ["native", "bridge"])
@pytest.mark.parametrize("key", ["too_short_dropped", "bad_records"])
def test_a_count_recorded_as_a_boolean_is_a_finding(copy, kind, key):
    """true is an int to Python: a count no data check recomputes, recorded as true and the
    checksum sealed again, is still a mistyped field."""
    out = copy(kind)
    edit_metadata(out, metadata_name(kind), lambda doc: doc["counts"].update({key: True}))
    assert_refused(out, f"counts.{key} has an unexpected value True", "training" if kind == "bridge" else None)


def test_a_recorded_vocab_size_of_0_is_a_schema_finding(copy):
    """vocab_size 0 (a vocabulary of no id) is a mistyped field, named as such, not only as every
    token being past it."""
    out = copy("native")
    edit_metadata(out, "metadata.json", lambda doc: doc["source"].update(vocab_size=0))
    assert_refused(out, "source.vocab_size has an unexpected value 0")


def _one_bad_record_on_line(line):
    def edit(doc):
        doc["bad_records"] = [{"path": "x.jsonl", "row": 0, "line": line, "reason": "not JSON"}]
        doc["counts"]["bad_records"] += 1
        doc["counts"]["records"] += 1
    return edit


@pytest.mark.parametrize("edit, says", [
    (lambda doc: doc["source"].update(tokens_field=""), "source.tokens_field has an unexpected value ''"),
    (lambda doc: doc.update(packer_version="1"), "metadata.packer_version has an unexpected value '1'"),
    (_one_bad_record_on_line(-1), "metadata.bad_records has an unexpected value"),
    (lambda doc: doc["counts"]["overlong"].pop("policy"), "counts.overlong.policy is missing [metadata.schema]"),
    (lambda doc: doc["bridge"].update(pack_size=True), "bridge.pack_size has an unexpected value True"),
], ids=["tokens-field-empty", "version-without-minor", "bad-record-line-negative", "overlong-policy-missing",
        "bridge-figure-a-boolean"])
def test_a_recorded_fact_of_an_impossible_value_is_a_schema_finding(copy, edit, says):
    """Fields no data check recomputes (the tokens field, the packer version, a listed bad
    record's line) edited to values no run writes, or removed, the checksum sealed again: each
    is named by the schema check, which inspect runs too."""
    out = copy("native")
    edit_metadata(out, "metadata.json", edit)
    assert_refused(out, says)


def test_a_listed_bad_record_of_no_line_passes(copy):
    """The positive side of the rule above: a bad record without a line (a Parquet row) is
    recorded with line null, and the output verifies."""
    out = copy("native")
    edit_metadata(out, "metadata.json", _one_bad_record_on_line(None))
    assert run("verify", out).exit_code == 0


def test_a_bridge_split_eos_id_below_0_is_a_finding(copy):
    """output.eos_id is an id (what the stored padding is checked against): -1, sealed again,
    is named by the schema check, which inspect runs too."""
    out = copy("bridge")
    edit_metadata(out, "training.metadata.json", lambda doc: doc["output"].update(eos_id=-1))
    assert_refused(out, "output.eos_id has an unexpected value -1", "training")
