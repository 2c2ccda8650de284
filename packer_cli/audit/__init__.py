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
from packer_cli.audit.inspect import InconsistentOutput, inspect_output
from packer_cli.audit.report import InspectReport, PackDetail
from packer_cli.audit.store import PackBatch, open_store
from packer_cli.audit.verify import VerifyReport, verify_output

__all__ = [
    "Finding", "FindingSink", "InconsistentOutput", "InspectReport", "PackBatch", "PackDetail", "VerifyReport",
    "inspect_output", "open_store", "verify_output",
]
