"""inspect/verify on a Megatron-Bridge layout holding two splits."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from packer_cli.cli import app
from packer_cli.demo import demo_table

runner = CliRunner()


@pytest.fixture(scope="module")
def two_splits(tmp_path_factory):
    d = tmp_path_factory.mktemp("splits")
    pq.write_table(demo_table(400, seed=1, max_len=1500), d / "train.parquet")
    pq.write_table(demo_table(150, seed=2, max_len=1500), d / "val.parquet")
    out = d / "bridge"
    for src, split in (("train.parquet", "training"), ("val.parquet", "validation")):
        r = runner.invoke(app, ["pack", str(d / src), "-o", str(out), "-C", "2048", "--format", "megatron-bridge",
                                "--split", split])
        assert r.exit_code == 0, r.output
    return d, out


def test_verify_checks_every_split_by_default(two_splits):
    d, out = two_splits
    r = runner.invoke(app, ["verify", str(out), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert sorted(doc["splits"]) == ["training", "validation"]
    packs = {name: rep["packs"] for name, rep in doc["splits"].items()}
    assert packs["training"] > packs["validation"] > 0


def test_source_needs_a_split_and_is_checked_against_it(two_splits):
    d, out = two_splits
    r = runner.invoke(app, ["verify", str(out), "--source", str(d / "val.parquet")])
    assert r.exit_code == 2 and "name the one it fed (--split)" in r.output
    ok = runner.invoke(app, ["verify", str(out), "--split", "validation", "--source", str(d / "val.parquet")])
    assert ok.exit_code == 0, ok.output
    wrong = runner.invoke(app, ["verify", str(out), "--split", "validation", "--source", str(d / "train.parquet")])
    assert wrong.exit_code == 1 and "source." in wrong.output


def test_inspect_one_split(two_splits):
    d, out = two_splits
    one = json.loads(runner.invoke(app, ["inspect", str(out), "--split", "validation", "--json"]).stdout)
    both = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).stdout)
    assert one == both["splits"]["validation"]
    assert one["totals"]["sequences"] == 150


def test_the_api_names_the_split_it_audits(two_splits, tmp_path):
    """verify_output("packed/") checked the training split alone and said OK over a truncated
    validation split (the CLI's exit 1): one report is one split's, so it must be named."""
    import shutil

    from packer_cli import ConfigError
    from packer_cli.audit import inspect_output, verify_output

    d, out = two_splits
    damaged = tmp_path / "bridge"
    shutil.copytree(out, damaged)
    data = next(damaged.glob("validation_*.idx.parquet"))
    data.write_bytes(data.read_bytes()[:-100])
    for audit in (verify_output, inspect_output):
        with pytest.raises(ConfigError, match="holds the splits training, validation: name the one"):
            audit(str(damaged))
    assert verify_output(str(damaged), split="training").ok
    assert not verify_output(str(damaged), split="validation").ok
    assert inspect_output(str(out), split="validation").sequences == 150


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_a_split_never_written_is_a_usage_error_and_a_damaged_one_a_finding(tmp_path, command):
    """``--split`` naming a split the layout never held is the user's mistake (exit 2, as
    ``--split`` on a native output); a split with a data file but no metadata is damage (exit 1)."""
    pq.write_table(demo_table(100, seed=3, max_len=1500), tmp_path / "train.parquet")
    out = tmp_path / "bridge"
    r = runner.invoke(app, ["pack", str(tmp_path / "train.parquet"), "-o", str(out), "-C", "2048",
                            "--format", "megatron-bridge"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, [command, str(out), "--split", "validation", "--json"])
    assert r.exit_code == 2, r.output
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == 2 and "holds no 'validation' split (it holds: training)" in doc["error"]
    (out / "validation_2048.idx.parquet").write_bytes((out / "training_2048.idx.parquet").read_bytes())
    assert runner.invoke(app, [command, str(out), "--split", "validation"]).exit_code == 1


def test_a_split_with_only_its_data_file_is_named_as_not_verified(two_splits, tmp_path):
    """The training split's metadata and manifest gone, its data file garbage (which Bridge would
    read): verify said OK over the validation split without a word of it. A data file alone may
    be a split Megatron-Bridge wrote itself, which packer cannot check: a warning, not a failure."""
    import shutil

    from packer_cli.audit import verify_output

    out = tmp_path / "bridge"
    shutil.copytree(two_splits[1], out)
    (out / "training.metadata.json").unlink()
    (out / "training.manifest.json").unlink()
    (out / "training_2048.idx.parquet").write_text("garbage")
    said = ("warning: training_2048.idx.parquet: the training split's data file is here without "
            "training.metadata.json or training.manifest.json (Megatron-Bridge's own split, or one that lost "
            "both): it is not verified [structure.unverified]")
    r = runner.invoke(app, ["verify", str(out)])
    assert r.exit_code == 0 and said in r.output, r.output
    report = verify_output(str(out))
    assert report.ok and [f.check for f in report.findings] == ["structure.unverified"]
    assert runner.invoke(app, ["inspect", str(out)]).exit_code == 0  # the validation split's summary
    r = runner.invoke(app, ["verify", str(out), "--split", "training"])
    assert r.exit_code == 1 and "training_2048.idx.parquet: the training split's data file is here without" in r.output


@pytest.mark.parametrize("damaged_split", ["training", "validation"])
def test_verify_of_every_split_fails_when_any_one_split_has_problems(two_splits, tmp_path, damaged_split):
    """The exit status of ``verify`` over several splits is the worst split's, whichever split
    it is: a damaged split listed after a sound one must not be reported as exit 0."""
    import shutil

    out = tmp_path / "bridge"
    shutil.copytree(two_splits[1], out)
    data = next(out.glob(f"{damaged_split}_*.idx.parquet"))
    data.write_bytes(data.read_bytes()[:-100])
    r = runner.invoke(app, ["verify", str(out), "--json"])
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert {name: rep["ok"] for name, rep in doc["splits"].items()} == {
        "training": damaged_split != "training", "validation": damaged_split != "validation"}
