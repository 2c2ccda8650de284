"""What importing packer costs: numba (and its LLVM) loads only with the code that compiles.

A data-loader worker imports ``packer_cli.torch`` and reads shards with pyarrow; ``packer
--help`` needs typer. Neither should pay numba's import and set-up (~0.3 s and ~60 MB a
process, every spawned worker again). Each check runs in a fresh interpreter, since this
test process has long since imported everything.
"""
import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest

import packer_cli
import packer_cli.plan
from packer_cli.plan import algorithms, bounds
from packer_cli.shards.bridge_output import BridgeOutput

COMPILER_MODULES = ("numba", "llvmlite")


def loaded_after(code: str) -> set[str]:
    """Top-level modules loaded by running ``code`` in a fresh interpreter."""
    script = textwrap.dedent(code) + "\nimport json, sys\nprint(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_package_spec_and_cli_module_do_not_load_the_compiler():
    loaded = loaded_after("import packer_cli, packer_cli.spec, packer_cli.errors, packer_cli.cli\n"
                          "from packer_cli import BridgeOutput")
    assert not loaded & set(COMPILER_MODULES)
    assert "typer" in loaded  # the check sees real imports


def test_the_console_script_imports_nothing_of_its_own_before_it_takes_ctrl_c():
    """Until ``packer_cli._entry`` gives Ctrl-C its default action, a Ctrl-C prints Python's
    traceback: the package's ``__init__`` took 4 ms there importing the errors (with typing and
    threading), the window of 5 of 240 Ctrl-Cs a review sent 0-150 ms into a start."""
    code = ("import json, sys\n"
            "before = set(sys.modules)\n"
            "import packer_cli._entry\n"
            "print(json.dumps(sorted(set(sys.modules) - before)))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    new = set(json.loads(done.stdout))
    assert {m for m in new if m.startswith("packer_cli")} == {"packer_cli", "packer_cli._entry"}
    assert "typing" not in new and "threading" not in new, new


def test_packing_loads_the_compiler():
    loaded = loaded_after("import packer_cli\npacker_cli.first_fit_decreasing([3, 2, 2], 4)")
    assert set(COMPILER_MODULES) <= loaded


@pytest.mark.parametrize("layout", ["native", "megatron-bridge"])
def test_torch_side_reads_and_slices_shards_without_the_compiler(tmp_path, layout):
    pytest.importorskip("torch")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"input_ids": list(range(1, 5 + k % 23))}) + "\n" for k in range(80)))
    out = tmp_path / "out"
    output = BridgeOutput(eos_id=0) if layout == "megatron-bridge" else None
    packer_cli.pack([str(src)], str(out), packer_cli.PackSpec(pack_size=64, cp=2), output=output)
    loaded = loaded_after(f"""
        from packer_cli.torch import PackedDataset, THDLoader
        ds = PackedDataset({str(out)!r})
        batch = ds.micro_batch([1], cp_size=2, cp_rank=1)
        assert batch.num_tokens > 0
        for b in THDLoader(ds, cp_size=2, cp_rank=0, seed=1, device="cpu", num_workers=0, pin_memory=False):
            assert b.num_tokens > 0
    """)
    assert "torch" in loaded and "pyarrow" in loaded
    assert not loaded & set(COMPILER_MODULES)


def test_lazy_names_resolve_to_the_real_objects():
    assert packer_cli.first_fit_decreasing is algorithms.first_fit_decreasing
    assert packer_cli.BridgeOutput is BridgeOutput  # README: pack(..., output=BridgeOutput(...))
    from packer_cli import pipeline

    assert packer_cli.pack is pipeline.pack  # help(pack) shows its own docstring and signature
    assert "spill_memory" in inspect.signature(packer_cli.pack).parameters
    for name in packer_cli.__all__:
        assert getattr(packer_cli, name) is not None
    assert packer_cli.plan.martello_toth_l2 is bounds.martello_toth_l2
    assert "first_fit_decreasing" in dir(packer_cli) and "plan_packs" in dir(packer_cli.plan)
    for package in (packer_cli, packer_cli.plan):  # not what the package imports for itself
        assert not {"annotations", "importlib", "TYPE_CHECKING"} & set(dir(package))
    for name in packer_cli.plan.__all__:
        assert getattr(packer_cli.plan, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        packer_cli.plan.nope  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        packer_cli.nope  # noqa: B018


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc/self/task")
def test_cli_loads_numpy_with_one_blas_thread():
    """The CLI sets OPENBLAS_NUM_THREADS=1 before numpy loads (its spinning workers cost ~0.2 s
    of CPU a pack run): importing the CLI module must not load numpy, and numpy loaded after
    the setting starts no BLAS thread. A user's own setting wins."""
    code = """
        import os, sys
        os.environ.pop("OPENBLAS_NUM_THREADS", None)
        import packer_cli.cli as cli
        assert "numpy" not in sys.modules
        cli._single_threaded_blas()
        import numpy
        print(len(os.listdir("/proc/self/task")), os.environ["OPENBLAS_NUM_THREADS"])
    """
    script = textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1"]
    kept = subprocess.run([sys.executable, "-c", "import packer_cli.cli as c, os; c._single_threaded_blas(); "
                           "print(os.environ['OPENBLAS_NUM_THREADS'])"], capture_output=True, text=True,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "3"}, timeout=120)
    assert kept.stdout.strip() == "3"


def test_reading_and_checking_outputs_never_imports_pandas(tmp_path, synthetic_parquet):
    """pyarrow's ``np.asarray(array)`` and ``Array.to_numpy()`` import pandas when it is
    installed (datasets brings it): 0.13 s and ~40 MB of every ``inspect``/``verify`` and
    every loader worker. Packing, auditing and loading go through the buffers instead."""
    try:
        import pandas  # noqa: F401
    except ImportError:
        pytest.skip("pandas is not installed, so nothing could import it")
    native, bridge = tmp_path / "native", tmp_path / "bridge"
    src = str(synthetic_parquet)
    steps = f"""
        import packer_cli
        from packer_cli.audit import inspect_output, verify_output
        from packer_cli.shards.bridge_output import BridgeOutput
        spec = packer_cli.PackSpec(pack_size=4096, cp=2)
        packer_cli.pack([{src!r}], {str(native)!r}, spec)
        packer_cli.pack([{src!r}], {str(bridge)!r}, spec, output=BridgeOutput())
        for out in ({str(native)!r}, {str(bridge)!r}):
            assert inspect_output(out).packs > 0 and inspect_output(out, pack=1).detail is not None
            assert verify_output(out, [{src!r}]).ok
    """
    loaded = loaded_after(steps)
    assert {"pyarrow", "numba"} <= loaded and "pandas" not in loaded
    try:
        import torch  # noqa: F401
    except ImportError:
        return  # the loader's half needs torch
    loaded = loaded_after(f"""
        from packer_cli.torch import PackedDataset, THDLoader
        for out in ({str(native)!r}, {str(bridge)!r}):
            ds = PackedDataset(out)
            assert ds.micro_batch([0], cp_size=2, cp_rank=1).num_tokens > 0
            for b in THDLoader(ds, cp_size=2, cp_rank=0, seed=1, device="cpu", num_workers=0, pin_memory=False):
                assert b.num_tokens > 0
    """)
    assert "torch" in loaded and "pandas" not in loaded
