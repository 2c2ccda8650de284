"""`pack()` called from Python: arguments of the wrong type are ConfigErrors before anything is
read, string values of the enums are taken as the enums, and paths may be ``os.PathLike``."""
from __future__ import annotations

import json
import pathlib

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
    assert strings.to_dict()["spec"]["algorithm"] == "bfd"
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
    (dict(output=dict(eos_id="5")), "eos-id must be an integer, got '5'"),
    (dict(output=dict(row_group_size=2.5)), "row-group-size must be an integer, got 2.5"),
    (dict(shard_bytes="1MB"), "shard size must be a positive number of bytes, got '1MB'"),
    (dict(spec=dict(pad_id=1000), source=dict(vocab_size=1000)), "pad-id 1000 is not below vocab-size 1000"),
    (dict(source=dict(vocab_size=1000), output=dict(eos_id=1000)), "eos-id 1000 is not below vocab-size 1000"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m.split(",")[0].split(" is ")[0] for _, m in BAD])
def test_unusable_arguments_are_config_errors(data, tmp_path, kwargs, message):
    spec = PackSpec(pack_size=64, **kwargs.get("spec", {}))
    source = SourceSpec(**kwargs.get("source", {}))
    output = BridgeOutput(**kwargs["output"]) if "output" in kwargs else None
    with pytest.raises(ConfigError) as caught:
        pack([data], tmp_path / "out", spec, source, output=output, shard_bytes=kwargs.get("shard_bytes", 1 << 20))
    assert str(caught.value) == message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]  # nothing written


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
