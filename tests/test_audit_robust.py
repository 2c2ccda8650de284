"""`verify` and `inspect` on outputs whose JSON files, Bridge metadata array or shard list are broken.

Each broken output is a copy of a good one with one file edited. Neither command may crash
with a traceback or exit 0 on it: verify reports findings (exit 1), inspect a one-line error
naming the problem (exit 1, the code verify uses for it). Inspect runs only checks that need
no read of the shards' content (it never hashes them), so a flipped byte inside a shard
stays verify's to find.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from packer_cli.shards.format import seal_metadata

from damage import make_outputs, run

C = 1024
ARRAY = f"{C}_metadata.jsonl"
NOT_OBJECTS = ["[]", "null", "1", '"text"', "[{}]"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_outputs(tmp_path_factory.mktemp("robust"), C, (400, 120), max_len=900, batch_tokens=20_000)


def audits(out: Path, source: Path, split: str | None = None):
    """Every audit command line on ``out``: verify plain and with --source, inspect plain, --json, --pack."""
    pick = ["--split", split] if split else []
    return [["verify", out, *pick], ["verify", out, "--source", source, *pick], ["inspect", out, *pick],
            ["inspect", out, "--json", *pick], ["inspect", out, "--pack", "0", *pick]]


def load(path: Path):
    return json.loads(path.read_text())


def save(path: Path, doc, seal: bool = False) -> None:
    if seal:  # a consistent edit: the metadata's own checksum is made to hold again
        doc.pop("checksum", None)
        doc = seal_metadata(doc)
    path.write_text(json.dumps(doc))


def assert_fails(out: Path, source: Path, names: str, split: str | None = None) -> None:
    """Every audit command exits 1 and names ``names`` (a file or a check)."""
    for args in audits(out, source, split):
        result = run(*args)
        assert result.exit_code == 1, (args, result.output)
        assert names in result.output, (args, result.output)


def test_good_outputs_pass_everything(made):
    for kind, split, src in (("native", None, made["train"]), ("bridge", "training", made["train"]),
                             ("bridge", "validation", made["val"])):
        for args in audits(made[kind], src, split):
            result = run(*args)
            assert result.exit_code == 0, (args, result.output)
    doc = json.loads(run("verify", made["bridge"], "--json").stdout)
    assert all(rep["ok"] for rep in doc["splits"].values())


# --- D4: the Bridge split's JSON files hold something other than what packer wrote -------------

@pytest.mark.parametrize("text", NOT_OBJECTS + ['{"format": "megatron-bridge", "format_version": 1}'])
@pytest.mark.parametrize("name", ["training.manifest.json", "training.metadata.json"])
def test_bridge_json_that_is_not_its_object(copy, made, name, text):
    out = copy("bridge")
    (out / name).write_text(text)
    assert_fails(out, made["train"], name, split="training")


@pytest.mark.parametrize("edit", [
    lambda e: e.pop("name"), lambda e: e.update(name=None), lambda e: e.update(name=7),
    lambda e: e.update(name="../escape.parquet"), lambda e: e.update(bytes="12"), lambda e: e.update(rows=None),
    lambda e: e.update(tokens=-1), lambda e: e.update(xxh3_64=3),
], ids=["no-name", "name-null", "name-int", "name-path", "bytes-str", "rows-null", "tokens-negative", "hash-int"])
def test_bridge_manifest_entry_with_a_missing_or_mistyped_key(copy, made, edit):
    out = copy("bridge")
    manifest = load(out / "training.manifest.json")
    edit(manifest["shards"][0])
    save(out / "training.manifest.json", manifest)
    assert_fails(out, made["train"], "training.manifest.json", split="training")


@pytest.mark.parametrize("shards", [None, {}, [1], [[]], []])
def test_bridge_manifest_shards_not_a_list_of_entries(copy, made, shards):
    out = copy("bridge")
    manifest = load(out / "training.manifest.json")
    manifest["shards"] = shards
    save(out / "training.manifest.json", manifest)
    assert_fails(out, made["train"], "training.manifest.json" if shards != [] else "[structure.totals]",
                 split="training")


@pytest.mark.parametrize("key,value", [("spec", []), ("counts", []), ("bridge", None), ("source", "x"),
                                       ("checksum", []), ("pad_id", "x"), ("pad_id", None)])
def test_bridge_metadata_field_with_a_wrong_shape(copy, made, key, value):
    """Even when the checksum is made to hold again, a mistyped field is a finding, never a crash."""
    out = copy("bridge")
    meta = load(out / "training.metadata.json")
    if key == "pad_id":
        meta["spec"][key] = value
    else:
        meta[key] = value
    save(out / "training.metadata.json", meta, seal=key != "checksum")
    assert_fails(out, made["train"], "metadata", split="training")


@pytest.mark.parametrize("text", NOT_OBJECTS + ['{"shards": null}', '{"format": "packer-thd"}'])
@pytest.mark.parametrize("name", ["manifest.json", "metadata.json"])
def test_native_json_that_is_not_its_object(copy, made, name, text):
    out = copy("native")
    (out / name).write_text(text)
    assert_fails(out, made["train"], name)


# --- D5: Bridge's own metadata file, {C}_metadata.jsonl ---------------------------------------

@pytest.mark.parametrize("text,says", [
    (None, "missing"), ("", "cannot read"), ("[{", "cannot read"), ("[]", "holds no entry"),
    ("null", "not a JSON array of dicts"), ("{}", "not a JSON array of dicts"), ("[1, 2]", "not a JSON array of dicts"),
    ("[" * 100_000 + "]" * 100_000, "cannot read"),
])
def test_bridge_array_missing_or_malformed(copy, made, text, says):
    out = copy("bridge")
    if text is None:
        (out / ARRAY).unlink()
    else:
        (out / ARRAY).write_text(text)
    for split, src in (("training", made["train"]), ("validation", made["val"])):
        result = run("verify", out, "--split", split, "--source", src)
        assert result.exit_code == 1, result.output
        line = next(x for x in result.output.splitlines() if "[bridge.array]" in x)
        assert line.startswith(f"{ARRAY}: ") and says in line, line
    assert run("verify", out).exit_code == 1
    assert_fails(out, made["train"], ARRAY, split="training")


@pytest.mark.parametrize("key,value", [("pack_size", 2 * C), ("pack_size", C // 2), ("max_samples_per_bin", 1), ("dataset_max_seqlen", 8),
                                       ("min_packed_seqlen", 1), ("packing_factor", 0.5),
                                       ("packing_efficiency", 12.5)])
def test_edited_bridge_array_entry(copy, made, key, value):
    out = copy("bridge")
    array = load(out / ARRAY)
    meta = load(out / "training.metadata.json")
    k = array.index(meta["bridge"])
    true = array[k][key]
    array[k][key] = value
    save(out / ARRAY, array)
    result = run("verify", out, "--split", "training", "--source", made["train"])
    assert result.exit_code == 1, result.output
    line = next(x for x in result.output.splitlines() if "[bridge.entry]" in x)
    assert f"{key} is {value!r} but the data has {true!r}" in line, line
    assert "training" in line
    other = run("verify", out, "--split", "validation")  # the other split's entry is intact
    if key == "pack_size":  # but no entry may have another pack size than the file's
        assert other.exit_code == 1 and "[bridge.array]" in other.output and "[bridge.entry]" not in other.output
    else:
        assert other.exit_code == 0, other.output
    assert_fails(out, made["train"], "[bridge.entry]", split="training")


def test_bridge_array_entry_of_a_mistyped_key(copy, made):
    out = copy("bridge")
    array = load(out / ARRAY)
    array[0]["max_samples_per_bin"] = "63"
    save(out / ARRAY, array)
    result = run("verify", out, "--split", "training")
    assert result.exit_code == 1
    assert "entry 0: max_samples_per_bin is '63', expected an integer [bridge.array]" in result.output, result.output


@pytest.mark.parametrize("key,value,expected", [("packing_efficiency", -0.5, "a number"),
                                                ("max_samples_per_bin", True, "an integer")])
def test_bridge_array_entry_of_a_value_no_bridge_key_takes_is_named_in_every_splits_audit(copy, made, key, value,
                                                                                         expected):
    """A ratio below 0, or a boolean where a count belongs (JSON's true, which Python calls an
    int): the array is damaged whichever split is verified (the other split's entry intact)."""
    out = copy("bridge")
    array = load(out / ARRAY)
    k = array.index(load(out / "training.metadata.json")["bridge"])
    array[k][key] = value
    save(out / ARRAY, array)
    for split in ("training", "validation"):
        result = run("verify", out, "--split", split)
        assert result.exit_code == 1, result.output
        assert f"entry {k}: {key} is {value!r}, expected {expected} [bridge.array]" in result.output, result.output


def test_the_edited_entry_named_is_the_closest_to_the_split_not_a_stale_one(copy, made):
    """This split's entry edited and a stale one before it: the split's entry is the one that
    differs least from its values, and the stale one is what is left over."""
    out = copy("bridge")
    array = load(out / ARRAY)
    train = load(out / "training.metadata.json")["bridge"]
    k = array.index(train)
    true = train["max_samples_per_bin"]
    array[k] = dict(train, max_samples_per_bin=true + 5)
    stale = dict(train, max_samples_per_bin=true + 7, dataset_max_seqlen=8, min_packed_seqlen=1)
    save(out / ARRAY, [stale, *array])
    result = run("verify", out, "--split", "training")
    assert result.exit_code == 1
    assert (f"{ARRAY}: entry {k + 1}, the training split's: max_samples_per_bin is {true + 5} but the data has "
            f"{true} [bridge.entry]") in result.output, result.output
    assert "holds 3 entries for the 2 splits here" in result.output, result.output

def test_bridge_array_with_a_stale_or_missing_entry(copy, made):
    out = copy("bridge")
    array = load(out / ARRAY)
    save(out / ARRAY, array + [dict(array[0], max_samples_per_bin=array[0]["max_samples_per_bin"] + 5)])
    for split in ("training", "validation"):
        result = run("verify", out, "--split", split)
        assert result.exit_code == 1 and "holds 3 entries for the 2 splits here" in result.output, result.output
    val = load(out / "validation.metadata.json")["bridge"]
    save(out / ARRAY, [e for e in array if e != val])
    assert run("verify", out, "--split", "training").exit_code == 0
    result = run("verify", out, "--split", "validation")
    assert result.exit_code == 1 and "no entry describes the validation split" in result.output, result.output


@pytest.mark.parametrize("edited", [0, 1])
def test_splits_of_equal_values_each_claim_their_own_entry(made, tmp_path, edited):
    """Both splits packed from one input have equal entries; each split took the first equal one,
    so an edited second entry passed as "the other split's" and moved Bridge's max/min unseen.
    One assignment, in Bridge's split order, now gives each split its own entry: the one left
    over is the validation split's."""
    out = tmp_path / "same"
    for split in ("training", "validation"):
        result = run("pack", made["train"], "-o", out, "-C", C, "--cp", "2", "--format", "megatron-bridge",
                     "--split", split)
        assert result.exit_code == 0, result.output
    array = load(out / ARRAY)
    assert array[0] == array[1] and run("verify", out).exit_code == 0
    true = array[edited]
    array[edited] = dict(true, min_packed_seqlen=1, dataset_max_seqlen=C)
    save(out / ARRAY, array)
    says = (f"{ARRAY}: entry {edited}, the validation split's: dataset_max_seqlen is {C} but the data has "
            f"{true['dataset_max_seqlen']}; min_packed_seqlen is 1 but the data has {true['min_packed_seqlen']} "
            f"[bridge.entry]")
    for pick in ([], ["--split", "validation"]):
        result = run("verify", out, *pick)
        assert result.exit_code == 1 and says in result.output, result.output
        assert result.output.count("[bridge.entry]") == 1, result.output
    assert run("verify", out, "--split", "training").exit_code == 0  # its own entry is intact
    result = run("inspect", out)
    assert result.exit_code == 1 and f"entry {edited}, the validation split's" in result.output, result.output


def test_bridge_file_of_another_pack_size_is_unexpected(copy, made):
    out = copy("bridge")
    shutil.copy(out / ARRAY, out / f"{2 * C}_metadata.jsonl")
    result = run("verify", out, "--split", "training")
    assert result.exit_code == 1
    assert f"{2 * C}_metadata.jsonl: unexpected file" in result.output, result.output


# --- D8: inspect does not summarize an inconsistent native output ---------------------------

def _shards(out: Path) -> list:
    return load(out / "manifest.json")["shards"]


def _set_shards(out: Path, shards: list) -> None:
    manifest = load(out / "manifest.json")
    manifest["shards"] = shards
    save(out / "manifest.json", manifest)


def _drop_counts(out: Path) -> None:
    meta = load(out / "metadata.json")
    meta.pop("counts")
    save(out / "metadata.json", meta, seal=True)


def _bad_checksum(out: Path) -> None:
    meta = load(out / "metadata.json")
    meta["checksum"]["xxh3_64"] = "0" * 16
    save(out / "metadata.json", meta)


def _no_checksum(out: Path) -> None:
    meta = load(out / "metadata.json")
    meta.pop("checksum")
    save(out / "metadata.json", meta)


def _grow_shard(out: Path) -> None:
    path = out / _shards(out)[1]["name"]
    path.write_bytes(path.read_bytes() + b"\0" * 8)


def _truncate_shard(out: Path) -> None:
    path = out / _shards(out)[0]["name"]
    path.write_bytes(path.read_bytes()[:-100])


def _version(out: Path) -> None:
    meta = load(out / "metadata.json")
    meta["format_version"] = 9
    save(out / "metadata.json", meta, seal=True)


BREAKS = {
    "no-shards": (lambda out: _set_shards(out, []), "[structure.totals]"),
    "last-entry-removed": (lambda out: _set_shards(out, _shards(out)[:-1]), "[structure.totals]"),
    "middle-entry-removed": (lambda out: _set_shards(out, _shards(out)[:1] + _shards(out)[2:]), "[structure.order]"),
    "entry-rows-edited": (lambda out: _set_shards(out, [dict(_shards(out)[0], rows=1)] + _shards(out)[1:]),
                          "[structure.totals]"),
    "checksum-removed": (_no_checksum, "[metadata.checksum]"),
    "checksum-wrong": (_bad_checksum, "[metadata.checksum]"),
    "counts-missing": (_drop_counts, "[metadata.schema]"),
    "shard-longer": (_grow_shard, "[shard.size]"),
    "shard-truncated": (_truncate_shard, "[shard.size]"),
    "shard-missing": (lambda out: (out / _shards(out)[1]["name"]).unlink(), "[shard.missing]"),
    "unknown-version": (_version, "[structure.format]"),
    "extra-file": (lambda out: (out / "notes.txt").write_text("x"), "[structure.files]"),
}


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_inspect_refuses_an_inconsistent_native_output(copy, made, case):
    out = copy("native")
    breaks, check = BREAKS[case]
    breaks(out)
    for args in (["inspect", out], ["inspect", out, "--pack", "0"]):
        result = run(*args)
        assert result.exit_code == 1, (case, result.output)
        assert result.stdout == "" and check in result.stderr and "packer verify" in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    result = run("inspect", out, "--json")
    assert result.exit_code == 1 and check in result.stderr
    assert check.strip("[]") in {f["check"] for f in json.loads(result.stdout)["findings"]}, result.stdout
    result = run("verify", out)
    assert result.exit_code == 1 and check in result.output, result.output


def test_inspect_does_not_hash_the_shards(made, monkeypatch):
    """A flipped byte inside a shard is verify's to find: inspect reads no more than it needs."""
    from packer_cli.audit import verify
    from packer_cli.shards import writer

    def fail(path):
        raise AssertionError(f"inspect hashed {path}")

    monkeypatch.setattr(verify, "file_checksum", fail)
    monkeypatch.setattr(writer, "file_checksum", fail)
    assert run("inspect", made["native"]).exit_code == 0


# --- D9: the order of the manifest's shard list ---------------------------------------------

def test_reordered_shard_list(copy, made):
    out = copy("native")
    shards = _shards(out)
    assert len(shards) > 2
    _set_shards(out, shards[::-1])
    for args in (["verify", out], ["verify", out, "--source", made["train"]]):
        result = run(*args)
        assert result.exit_code == 1, result.output
        assert (f"manifest.json: shard entry 0 is {shards[-1]['name']}, but the writer names shard 0 "
                f"{shards[0]['name']}") in result.output, result.output
        assert "[structure.order]" in result.output
    result = run("inspect", out)
    assert result.exit_code == 1 and "[structure.order]" in result.stderr


def test_duplicated_shard_entry(copy, made):
    out = copy("native")
    shards = _shards(out)
    _set_shards(out, shards + [shards[0]])
    for args in (["verify", out], ["inspect", out]):
        result = run(*args)
        assert result.exit_code == 1 and f"shard {shards[0]['name']} is listed twice" in result.output, result.output


# --- files that cannot be read, or are not files --------------------------------------------

@pytest.mark.parametrize("kind,name,says", [
    ("native", "metadata.json", "not a regular file"), ("native", "manifest.json", "not a regular file"),
    ("bridge", "training.metadata.json", "training.metadata.json: not a regular file, but training.manifest.json"),
    ("bridge", "training.manifest.json", "not a regular file"), ("bridge", ARRAY, f"{ARRAY}: missing")])
def test_a_fifo_in_place_of_a_json_file_is_a_finding_not_a_hang(copy, made, kind, name, says):
    """A FIFO would block the reader forever (no writer ever comes): it is opened without
    blocking and reported as not a regular file. Run as processes, so a hang fails by timeout."""
    import os
    import subprocess
    import sys

    out = copy(kind)
    (out / name).unlink()
    os.mkfifo(out / name)
    pick = ["--split", "training"] if kind == "bridge" else []
    for command in ("verify", "inspect"):
        result = subprocess.run([sys.executable, "-m", "packer_cli.cli", command, str(out), *pick],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 1, (command, result.stdout, result.stderr)
        assert says in result.stdout + result.stderr and "Traceback" not in result.stderr


def test_an_unlistable_output_directory_is_a_one_line_error(copy, monkeypatch):
    import os

    out = copy("native")
    listdir = os.listdir

    def refuse(path="."):
        if os.path.abspath(path) == str(out):
            raise PermissionError(13, "Permission denied")
        return listdir(path)

    monkeypatch.setattr(os, "listdir", refuse)
    for command in ("verify", "inspect"):
        result = run(command, out)
        assert result.exit_code == 2 and "cannot list the directory (Permission denied)" in result.output, \
            result.output
        assert len(result.output.strip().splitlines()) == 1


def test_a_shard_that_cannot_be_read_is_a_finding(copy, made, monkeypatch):
    from packer_cli.audit import verify

    out = copy("native")
    first = _shards(out)[0]["name"]
    checksum = verify.file_checksum

    def refuse(path):
        if path.endswith(first):
            raise PermissionError(13, "Permission denied")
        return checksum(path)

    monkeypatch.setattr(verify, "file_checksum", refuse)
    result = run("verify", out)
    assert result.exit_code == 1, result.output
    assert f"{first}: cannot be read (Permission denied) [shard.unreadable]" in result.output
    assert result.output.count("[shard.unreadable]") == 1  # the rows of a file that cannot be read are not tried


@pytest.mark.parametrize("what", ["a directory", "a FIFO"])
def test_a_listed_shard_that_is_not_a_regular_file_is_named_for_what_it_is(copy, what):
    """A shard replaced by a directory or a FIFO of its name is reported as not a regular file
    (shard.missing), not measured as a truncated shard: a directory has a size of its own, a FIFO
    one of 0. Run as processes, so a FIFO opened for reading fails by timeout, not a hang."""
    import os
    import subprocess
    import sys

    out = copy("native")
    shard = out / _shards(out)[0]["name"]
    shard.unlink()
    shard.mkdir() if what == "a directory" else os.mkfifo(shard)
    says = (f"{shard.name}: listed in manifest.json but not a regular file (a directory, FIFO, socket or device) "
            "[shard.missing]")
    for command in ("verify", "inspect"):
        result = subprocess.run([sys.executable, "-m", "packer_cli.cli", command, str(out)], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 1, (command, result.stdout, result.stderr)
        assert says in result.stdout + result.stderr and "[shard.size]" not in result.stdout + result.stderr
