"""`pack()` called from Python: arguments of the wrong type are ConfigErrors before anything is
read, string values of the enums are taken as the enums, and paths may be ``os.PathLike``."""
from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import orjson
import pytest
from typer.testing import CliRunner

from packer_cli import ConfigError, PackSpec, SourceSpec, pack
from packer_cli.cli import app
from packer_cli.shards.bridge_output import BridgeOutput
from packer_cli.shards.format import seal_metadata
from packer_cli.spec import Algorithm, BadRecordPolicy, OverlongPolicy

RECORDS = [{"input_ids": list(range(1, 2 + n % 37)), "loss_mask": [0] + [1] * (n % 37)} for n in range(200)]


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in RECORDS))
    return path


def test_paths_may_be_pathlike_or_one_string(data, tmp_path):
    a = pack([data], tmp_path / "a", PackSpec(pack_size=64))  # pathlib.Path inputs and output
    b = pack(str(data), str(tmp_path / "b"), PackSpec(pack_size=64))  # one path, not a list of letters
    assert a.counts == b.counts and a.counts["records"] == len(RECORDS)
    assert (tmp_path / "a" / "manifest.json").read_bytes() == (tmp_path / "b" / "manifest.json").read_bytes()


def test_enum_values_given_as_strings_are_the_enums(data, tmp_path):
    spec = PackSpec(pack_size=64, algorithm="bfd", overlong="split")
    assert spec.algorithm is Algorithm.BFD and spec.overlong is OverlongPolicy.SPLIT
    assert SourceSpec(on_bad_record="skip").on_bad_record is BadRecordPolicy.SKIP
    strings = pack([data], tmp_path / "s", spec)
    enums = pack([data], tmp_path / "e", PackSpec(pack_size=64, algorithm=Algorithm.BFD, overlong=OverlongPolicy.SPLIT))
    assert (tmp_path / "s" / "manifest.json").read_bytes() == (tmp_path / "e" / "manifest.json").read_bytes()
    assert strings.to_dict()["spec"]["algorithm"] == "bfd" and strings.spec == enums.spec
    with pytest.raises(ConfigError, match="algorithm must be one of ffd, bfd, first-fit-shuffle, sequential, got 'xx'"):
        PackSpec(pack_size=64, algorithm="xx")


BAD = [
    (dict(spec=dict(seed=1.5)), "seed must be an integer, got 1.5"),
    (dict(spec=dict(seed=None)), "seed must be an integer, got None"),
    (dict(spec=dict(pad_id="0")), "pad-id must be an integer, got '0'"),
    (dict(spec=dict(pad_id=1.5)), "pad-id must be an integer, got 1.5"),
    (dict(spec=dict(pad_seq_to_mult=4.0)), "pad-seq-to-mult must be an integer, got 4.0"),
    (dict(spec=dict(pad_seq_to_mult=True)), "pad-seq-to-mult must be an integer, got True"),
    (dict(spec=dict(sp="false")), "sp must be True or False, got 'false'"),  # a non-empty string is truthy
    (dict(spec=dict(shuffle="no")), "shuffle must be True or False, got 'no'"),
    (dict(spec=dict(refine=None)), "refine must be True or False, got None"),
    (dict(source=dict(vocab_size="100")), "vocab-size must be an integer, got '100'"),
    (dict(source=dict(tokens_field="")), "tokens-field must be a field name, got ''"),
    # the other fields may be None (not read); the tokens field may not (else a traceback when reading)
    (dict(source=dict(tokens_field=None)), "tokens-field must be a field name, got None"),
    # 0 would have been recorded as an override of m = 1, a negative one taken as the alignment
    (dict(spec=dict(pad_seq_to_mult=0)),
     "pad-seq-to-mult 0 must be a positive multiple of 1, the alignment required by CP=1, TP=1, SP=off"),
    (dict(spec=dict(pad_seq_to_mult=-4)),
     "pad-seq-to-mult -4 must be a positive multiple of 1, the alignment required by CP=1, TP=1, SP=off"),
    # past 2**63 the run failed after packing everything, when the metadata's JSON was written
    (dict(source=dict(vocab_size=2**64)), "vocab-size must be from 1 to 2**63, got 18446744073709551616"),
    (dict(source=dict(vocab_size=0)), "vocab-size must be from 1 to 2**63, got 0"),
    # argv bytes that are not UTF-8 (Python decodes them to lone surrogates) were blamed on the input
    (dict(source=dict(mask_field="m\udcff")), "mask-field 'm\\udcff' is not UTF-8 text (field names in JSON, "
                                               "Parquet and Arrow files are)"),
    (dict(output=dict(eos_id="5")), "eos-id must be an integer, got '5'"),
    (dict(output=dict(row_group_size=2.5)), "row-group-size must be an integer, got 2.5"),
    (dict(output=dict(row_group_size=2**70)),  # it failed after the whole run, writing the metadata's JSON
     "row-group-size must be a number of packs from 1 to 2**31 - 1, got 1180591620717411303424"),
    (dict(shard_bytes="1MB"), "shard size must be a positive number of bytes, got '1MB'"),
    (dict(spec=dict(pad_id=1000), source=dict(vocab_size=1000)), "pad-id 1000 is not below vocab-size 1000"),
    (dict(source=dict(vocab_size=1000), output=dict(eos_id=1000)), "eos-id 1000 is not below vocab-size 1000"),
]


LIMITS = [  # (the last value taken, the first refused, what is said): each bound at its edge
    (dict(spec=dict(seed=2**32 - 1)), dict(spec=dict(seed=2**32)), "seed must be in [0, 2**32), got 4294967296"),
    (dict(spec=dict(pad_id=2**31 - 1)), dict(spec=dict(pad_id=2**31)),
     "pad-id must be a non-negative int32, got 2147483648"),
    (dict(spec=dict(pack_size=1 << 24)), dict(spec=dict(pack_size=(1 << 24) + 1)),
     "pack-size 16,777,217 is above the largest supported, 16,777,216 tokens (the planners keep tables with one "
     "entry per token of capacity)"),
    (dict(spec=dict(pack_size=96, pad_seq_to_mult=8, pad_to_max_length=True)),
     dict(spec=dict(pack_size=100, pad_seq_to_mult=8, pad_to_max_length=True)),
     "--pad-to-max-length needs pack-size 100 to be a multiple of the alignment 8, so the tail segment is itself "
     "aligned"),
    (dict(output=dict(eos_id=2**31 - 1)), dict(output=dict(eos_id=2**31)),
     "eos-id must be a non-negative int32, got 2147483648"),
    (dict(output=dict(row_group_size=2**31 - 1)), dict(output=dict(row_group_size=2**31)),
     "row-group-size must be a number of packs from 1 to 2**31 - 1, got 2147483648"),
    # the 2*CP rule holds only with context parallelism: an odd pack size is fine with CP = 1
    (dict(spec=dict(pack_size=63)), dict(spec=dict(pack_size=63, cp=2)),
     "pack-size 63 must be divisible by 2*CP = 4 with context parallelism; use --pack-size 60 or 64"),
]
BAD += [(bad, message) for _, bad, message in LIMITS]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m.split(",")[0].split(" is ")[0] for _, m in BAD])
def test_unusable_arguments_are_config_errors(data, tmp_path, kwargs, message):
    spec = PackSpec(**{"pack_size": 64, **kwargs.get("spec", {})})
    source = SourceSpec(**kwargs.get("source", {}))
    output = BridgeOutput(**kwargs["output"]) if "output" in kwargs else None
    with pytest.raises(ConfigError) as caught:
        pack([data], tmp_path / "out", spec, source, output=output, shard_bytes=kwargs.get("shard_bytes", 1 << 20))
    assert str(caught.value) == message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]  # nothing written


@pytest.mark.parametrize("good", [good for good, _, _ in LIMITS], ids=["seed", "pad-id", "pack-size",
                                                                       "pad-to-max-length", "eos-id", "row-group-size",
                                                                       "odd-pack-size-without-cp"])
def test_each_bound_takes_its_last_value(good):
    """A bound one off (``<=`` for ``<``) took the first value past it, and the run failed later
    with a traceback (a seed of 2**32 in NumPy, a pack size of 2**24 + 1 in the planner's
    checks) or wrote wrong output (an EOS id of 2**31 stored as -2**31). The first value past
    each bound is in ``BAD``; here the last one inside it is taken."""
    PackSpec(**{"pack_size": 64, **good.get("spec", {})}).validate()
    if "output" in good:
        BridgeOutput(**good["output"]).validate()


@pytest.mark.parametrize("args", [(None,), ([1],)], ids=["spec-None", "input-not-a-path"])
def test_wrong_kinds_of_argument(data, tmp_path, args):
    with pytest.raises(ConfigError):
        if args == (None,):
            pack([data], tmp_path / "out", None)
        else:
            pack(args[0], tmp_path / "out", PackSpec(pack_size=64))


def test_verify_flags_a_pad_id_outside_the_recorded_vocabulary(data, tmp_path):
    """An output whose padding id is not below its recorded vocab size (packed before pack()
    refused it, or edited and sealed again) is a finding, with and without --source."""
    out = tmp_path / "out"
    pack([data], out, PackSpec(pack_size=64, cp=2, pad_id=7), SourceSpec(vocab_size=100))
    meta = json.loads((out / "metadata.json").read_text())
    meta.pop("checksum")
    meta["source"]["vocab_size"] = 7
    (out / "metadata.json").write_text(json.dumps(seal_metadata(meta)))
    runner = CliRunner()
    for extra in ([], ["--source", str(data)]):
        result = runner.invoke(app, ["verify", str(out), *extra])
        assert result.exit_code == 1, result.output
        assert "spec.pad_id 7 is not below source.vocab_size 7" in result.output and "Traceback" not in result.output


def test_pathlib_output_and_spill_dir(data, tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir()
    summary = pack([pathlib.Path(data)], tmp_path / "out", PackSpec(pack_size=64), spill_dir=spill)
    assert summary.counts["records"] == len(RECORDS) and list(spill.iterdir()) == []


def test_verify_source_of_a_spec_with_a_float_alignment_is_a_finding(data, tmp_path):
    """A recorded spec whose numbers are not integers is unusable: verify says so (and skips the
    source comparison) instead of failing inside it with a traceback."""
    out = tmp_path / "out"
    pack([data], out, PackSpec(pack_size=64, pad_seq_to_mult=4))
    meta = json.loads((out / "metadata.json").read_text())
    meta.pop("checksum")
    meta["spec"]["pad_seq_to_mult"] = 4.0
    (out / "metadata.json").write_text(json.dumps(seal_metadata(meta)))
    result = CliRunner().invoke(app, ["verify", str(out), "--source", str(data)])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "pad-seq-to-mult must be an integer, got 4.0" in result.output and "[source.skipped]" in result.output


# --- a helper's fuzz round: flags, NumPy integers, paths, the audit API, --json and sizes ------

@pytest.mark.parametrize("kwargs,says", [
    (dict(overwrite="false"), "overwrite must be True or False, got 'false'"),
    (dict(dry_run="no"), "dry_run must be True or False, got 'no'"),
    (dict(direct_io="false"), "direct_io must be True, False or None, got 'false'"),
    (dict(spill_dir=5), "spill_dir must be a path"),
    (dict(spill_dir=b"/tmp"), "spill_dir must be a path"),
    (dict(output="megatron-bridge"), "output must be a BridgeOutput or None"),
])
def test_flags_and_paths_of_the_wrong_type_are_refused(data, tmp_path, kwargs, says):
    """overwrite="false" is truthy: it replaced an existing output."""
    first = pack([data], tmp_path / "out", PackSpec(pack_size=64))
    with pytest.raises(ConfigError, match=re.escape(says)):
        pack([data], tmp_path / "out", PackSpec(pack_size=32), **kwargs)
    assert json.loads((tmp_path / "out" / "metadata.json").read_text())["spec"] == first.spec


@pytest.mark.parametrize("out,inputs", [(5, None), (b"/tmp/x", None), ("x", [b"data.jsonl"])])
def test_bytes_or_numbers_as_paths_are_refused_and_nothing_is_made(data, tmp_path, monkeypatch, out, inputs):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="must be a path"):
        pack(inputs or [data], out, PackSpec(pack_size=64))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]


@pytest.mark.parametrize("argv, says", [
    (["pack", "", "-o", "out"], "INPUTS: an empty path"),
    (["pack", "data.jsonl", "-o", ""], "--out: an empty path"),
    (["pack", "data.jsonl", "-o", "out", "--spill-dir", ""], "--spill-dir: an empty path"),
    (["inspect", ""], "OUT: an empty path"),
    (["verify", ""], "OUT: an empty path"),
    (["verify", "out", "--source", ""], "--source: an empty path"),
])
def test_an_empty_path_is_named_as_one(data, tmp_path, monkeypatch, argv, says):
    """It said "error: : no such file or directory", naming nothing (then the API's parameter,
    'spill_dir: an empty path', where the command line spells it --spill-dir)."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2 and f"error: {says} ('')" in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]


def test_numpy_integers_and_bools_are_taken_and_recorded_as_json(data, tmp_path):
    spec = PackSpec(pack_size=np.int64(64), cp=np.int32(2), sp=np.bool_(False), seed=np.uint8(3))
    summary = pack([data], tmp_path / "np", spec, SourceSpec(vocab_size=np.int64(100)), shard_bytes=np.int64(1 << 20),
                   spill_memory=np.int64(0), output=BridgeOutput(row_group_size=np.int64(4), eos_id=np.int64(2)))
    plain = pack([data], tmp_path / "plain", PackSpec(pack_size=64, cp=2, seed=3), SourceSpec(vocab_size=100),
                 output=BridgeOutput(row_group_size=4, eos_id=2))
    assert summary.spec == plain.spec and type(summary.spec["pack_size"]) is int
    assert summary.counts == plain.counts


def test_the_audit_api_takes_paths_one_source_string_and_numpy_indices(data, tmp_path):
    from packer_cli.audit import inspect_output, verify_output

    out = tmp_path / "out"
    pack([data], out, PackSpec(pack_size=64))
    report = inspect_output(out, pack=np.int64(3))
    json.dumps(report.to_dict())  # a Path or an np.int64 in it did not serialize
    assert report.to_dict()["out"] == str(out)
    for sources in (str(data), data, [data]):  # a bare string was read as one-letter paths
        result = verify_output(out, sources=sources)
        assert result.ok and json.dumps(result.to_dict())
    for bad, says in ((dict(pack=3.0), "pack must be an integer"), (dict(pack="3"), "pack must be an integer"),
                      (dict(pack=True), "pack must be an integer")):
        with pytest.raises(ConfigError, match=says):
            inspect_output(out, **bad)
    with pytest.raises(ConfigError, match="out must be a path"):
        inspect_output(None)
    for limit in (-1, None, "5"):
        with pytest.raises(ConfigError, match="limit must be an integer >= 0"):
            verify_output(out, limit=limit)


def test_verify_limit_zero_lists_no_problem_and_counts_them_all(data, tmp_path):
    out = tmp_path / "out"
    pack([data], out, PackSpec(pack_size=64))
    for name in ("x1", "x2", "x3"):
        (out / name).write_text("stray")
    result = CliRunner().invoke(app, ["verify", str(out), "--limit", "0", "--json"])
    doc = json.loads(result.stdout)
    assert [(f["message"], f["omitted"]) for f in doc["findings"]] == [("3 more structure.files problems not shown", 3)]


@pytest.mark.parametrize("argv,code", [
    (["pack", "DATA", "-o", "OUT", "-C", "512", "--cp", "3", "--json"], 2),
    (["pack", "nope.jsonl", "-o", "OUT", "--json"], 1),
    (["inspect", "OUT", "--pack", "abc", "--json"], 2),
    (["verify", "OUT", "--limit", "x", "--json"], 2),
    (["--json", "inspect", "OUT"], 2),  # --json where the group takes no such option: still a document
])
def test_json_failures_print_a_document_on_stdout(data, tmp_path, argv, code):
    """A pipeline reading stdout got an empty page from pack and from typer's own checks."""
    argv = [str(data) if a == "DATA" else str(tmp_path / "out") if a == "OUT" else a for a in argv]
    script = "import sys; sys.argv[0] = 'packer'; from packer_cli._entry import main; main()"
    child = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=60,
                           cwd=tmp_path)
    assert child.returncode == code, child.stderr
    doc = json.loads(child.stdout)
    assert doc["ok"] is False and doc["exit_code"] == code and doc["error"] in child.stderr
    # the document's error is the stderr line's message, without its "error: " prefix
    assert child.stderr.strip().splitlines()[-1] == f"error: {doc['error']}", (child.stderr, doc)


@pytest.mark.parametrize("size,bytes_", [("512B", 512), ("4kib", 4096), ("1.5K", 1536), ("0", 0), ("1e3", 1000),
                                         ("1_000", 1000), ("9007199254740993", 9007199254740993),
                                         ("8M", 8 << 20), (str(2**63 - 1), 2**63 - 1),
                                         ("1T", 1 << 40), ("2TB", 2 << 40), ("3GiB", 3 << 30), ("1GB", 1 << 30)])
def test_sizes_take_a_byte_suffix(size, bytes_):
    from packer_cli.cli import parse_size

    assert parse_size(size, "--spill-memory") == bytes_


@pytest.mark.parametrize("size", ["99999999999999999999999", str(2**63), "8589934592G", "1e30"])
def test_a_size_beyond_any_file_or_address_space_is_refused_as_given(size):
    """It was rounded through a float: '99999999999999999999999' reached the spill's reservation
    as 99,999,999,999,999,991,611,392 bytes, and its error named that number."""
    from packer_cli.cli import parse_size

    with pytest.raises(ConfigError, match=rf"--spill-memory: '{size}' is more than 9,223,372,036,854,775,807 bytes"):
        parse_size(size, "--spill-memory")


@pytest.mark.parametrize("size", ["inf", "-inf", "1e400", "Infinity"])
def test_an_infinite_size_is_not_a_size(size):
    """float() takes these; int() of them raises OverflowError, which must not escape as a traceback."""
    from packer_cli.cli import parse_size

    with pytest.raises(ConfigError, match=rf"--shard-size: not a size: '{size}'"):
        parse_size(size, "--shard-size")


def test_a_size_below_one_byte_names_the_option():
    from packer_cli.cli import parse_size

    with pytest.raises(ConfigError, match=r"--shard-size: '0.5' is less than one byte"):
        parse_size("0.5", "--shard-size")


def test_refine_plan_refuses_a_plan_made_for_other_lengths():
    from packer_cli.plan import plan_packs, refine_plan

    plan = plan_packs([5, 5, 5, 5, 5, 5], 10)
    with pytest.raises(ValueError, match="not the sums of these lengths"):
        refine_plan([9, 9, 9, 1, 1, 1], plan)
    with pytest.raises(TypeError, match="plan must be a PackPlan"):
        refine_plan([1, 2], None)
    with pytest.raises(ValueError, match="max_rounds must be an integer >= 0"):
        refine_plan([5] * 6, plan, max_rounds=None)


def test_refine_plan_takes_a_round_count_of_zero_but_not_a_bool():
    """``max_rounds=0`` (no round: the plan as it is) is a valid count; ``True`` is no count,
    though ``bool`` is an ``int`` subclass, and is refused like ``None``."""
    from packer_cli.plan import plan_packs, refine_plan

    plan = plan_packs([6, 5, 4, 5], 10, "sequential")
    assert refine_plan([6, 5, 4, 5], plan, max_rounds=0).num_packs == plan.num_packs
    for value in (True, False):
        with pytest.raises(ValueError, match=f"max_rounds must be an integer >= 0, got {value}"):
            refine_plan([6, 5, 4, 5], plan, max_rounds=value)


def test_one_bridge_output_serves_two_runs_at_once(data, tmp_path):
    """The object held the run's state (OUT, spec): two threads sharing it sent one run's
    layout into the other's OUT and reported success for an output that was not there."""
    import threading

    shared = BridgeOutput()
    specs = {"a": PackSpec(pack_size=64), "b": PackSpec(pack_size=128)}
    results, start = {}, threading.Barrier(2)

    def run(name):
        start.wait()
        try:
            results[name] = pack([data], tmp_path / name, specs[name], output=shared)
        except Exception as exc:  # noqa: BLE001 - the assertion below names it
            results[name] = exc

    threads = [threading.Thread(target=run, args=(name,)) for name in specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    from packer_cli.audit import verify_output

    for name, spec in specs.items():
        assert not isinstance(results[name], Exception), results[name]
        assert (tmp_path / name / f"training_{spec.pack_size}.idx.parquet").is_file()
        assert verify_output(tmp_path / name).ok
    assert shared._out == "" and shared._spec is None  # each run worked on its own copy


def test_a_warn_that_cannot_be_called_is_refused_before_the_run(data, tmp_path):
    """warn=5 read, planned and wrote everything, then failed at the first warning with a
    bare TypeError, and the finished output was thrown away."""
    with pytest.raises(ConfigError, match="warn must be a callable taking one line of text, or None, got 5"):
        pack([data], tmp_path / "out", PackSpec(pack_size=64), warn=5)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", [set, frozenset, dict.fromkeys])
def test_inputs_in_no_fixed_order_are_refused(data, tmp_path, kind):
    """A set's order changes with the interpreter's hash seed: the same call gave other
    source indices and other bytes from one process to the next."""
    with pytest.raises(ConfigError, match="inputs must be one path or an ordered list of them"):
        pack(kind([data, tmp_path / "other.jsonl"]), tmp_path / "out", PackSpec(pack_size=64))


def test_an_api_audit_of_a_split_the_layout_never_held_is_a_config_error(data, tmp_path):
    """The CLI refused --split validation of a training-only layout (exit 2); verify_output
    reported it as damage (a missing manifest, exit 1) and inspect_output as InconsistentOutput."""
    from packer_cli.audit import inspect_output, verify_output

    pack([data], tmp_path / "out", PackSpec(pack_size=64), output=BridgeOutput())
    for audit in (verify_output, inspect_output):
        with pytest.raises(ConfigError, match=r"holds no 'validation' split \(it holds: training\)"):
            audit(tmp_path / "out", split="validation")
        for bad in ("test", 1):
            with pytest.raises(ConfigError, match="split must be one of training, validation"):
                audit(tmp_path / "out", split=bad)
    assert verify_output(tmp_path / "out", split="training").ok
