"""Audit packed outputs: ``inspect`` (what is in them) and ``verify`` (is all of it right).

::

    OUT ──open_store──▶ PackBatch, PackBatch, ...  (memory-mapped, column by column)
           │
           ├─ inspect_output(OUT, pack=N) ─▶ InspectReport   (+ to merge, to_dict/from_dict, rich)
           └─ verify_output(OUT, sources) ─▶ VerifyReport    (typed Findings with locations)

Example::

    from packer_cli.audit import inspect_output, verify_output
    report = verify_output("packed/", sources=["train.parquet"])
    if not report.ok:
        for finding in report.findings:
            print(finding.line())

docs/AUDIT.md documents the JSON keys, every check and the exit codes.
"""
from packer_cli.audit.findings import Finding, FindingSink

# The rest loads on first use: inspect and verify bring numba with their kernels, and the
# loader (``packer_cli.shards.reader``) runs the layout checks of this package without them.
_LAZY = {
    "InconsistentOutput": "packer_cli.audit._layout_checks", "inspect_output": "packer_cli.audit.inspect",
    "InspectReport": "packer_cli.audit.report", "PackDetail": "packer_cli.audit.report",
    "PackBatch": "packer_cli.audit.store", "open_store": "packer_cli.audit.store",
    "VerifyReport": "packer_cli.audit.verify", "verify_output": "packer_cli.audit.verify",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["Finding", "FindingSink", *_LAZY]
