"""packer: offline sequence packing for LLM fine-tuning.

::

    from packer_cli import PackSpec, pack, first_fit_decreasing
    summary = pack(["train.parquet"], "packed/", PackSpec(pack_size=4096, cp=2))

The CLI (``packer pack|inspect|verify``) is a thin layer over these functions.
"""
__version__ = "0.3.0"

import importlib  # noqa: E402

# Not ``typing.TYPE_CHECKING``: importing typing (~2 ms) is too much here, see _LAZY below.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from packer_cli.errors import ConfigError, DataError, OutputError, PackerError
    from packer_cli.pipeline import pack
    from packer_cli.plan import first_fit_decreasing
    from packer_cli.shards.bridge_output import BridgeOutput
    from packer_cli.spec import Algorithm, BadRecordPolicy, OverlongPolicy, PackSpec, SourceSpec


# Loaded on first use. numba comes with the planner: ``import packer_cli.torch`` (every data
# loader worker) and ``packer --help`` never pay its ~0.3 s and ~60 MB. The specs come with
# dataclasses and friends (~20 ms), and even the errors with typing and threading (~4 ms): the
# ``packer`` console script imports this package before it can give Ctrl-C its default action
# (``packer_cli._entry``), and a Ctrl-C meanwhile prints Python's traceback, so the package
# itself imports nothing of its own (a review: 5 of 240 Ctrl-Cs 0-150 ms into a start did).
_LAZY = {
    **{name: "packer_cli.errors" for name in ("ConfigError", "DataError", "OutputError", "PackerError")},
    "first_fit_decreasing": "packer_cli.plan",
    **{name: "packer_cli.spec" for name in ("Algorithm", "BadRecordPolicy", "OverlongPolicy", "PackSpec", "SourceSpec")},
    "BridgeOutput": "packer_cli.shards.bridge_output",  # pack(..., output=BridgeOutput(...))
    # the function itself, so that help(pack) and its signature are the real ones (a wrapper
    # showed ``(*args, **kwargs)``); its module, and numba, load when the name is first taken
    "pack": "packer_cli.pipeline",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # Everything but the helpers this file imports for itself, plus the names not loaded yet.
    return sorted((set(globals()) - {"importlib", "TYPE_CHECKING"}) | set(_LAZY))


__all__ = [
    "Algorithm", "BadRecordPolicy", "BridgeOutput", "ConfigError", "DataError", "OutputError", "OverlongPolicy", "PackSpec",
    "PackerError", "SourceSpec", "first_fit_decreasing", "pack",
]
