"""Reference cycles per input file, while the cyclic garbage collector is off.

The CLI runs with the collector off (:func:`packer_cli.cli.main`: its full passes over the
objects numba and pyarrow create while loading cost ~0.1 s a start). pyarrow leaves each
Parquet file it opens in a reference cycle (``FileMetaData`` and ``ParquetSchema`` holding
each other, with the decoded footer: 10-90 KB a file), which only the collector frees: 5,000
files held 0.4 GB. So every :data:`FILES_PER_SWEEP` input files read, a sweep collects the
cycles, then freezes what survives (:func:`gc.freeze`), so that the next sweep passes over
only what came after it, not over every object numba and pyarrow made while loading.

Only the CLI, which turned the collector off itself, sweeps (:func:`sweep_while_collector_off`).
The library used from a program of its own does nothing here, the collector on or off: on, it
frees the cycles as it goes; off, that is the program's choice (a training loop collecting by
hand), and freezing a program's objects is not ours to do (a program with the collector off
had every object it held frozen by the 256th file, a cycle it dropped then never freed).
"""

from __future__ import annotations

import gc
import itertools

#: Input files read between two sweeps: a sweep's first pass over the start-up objects takes
#: 30-60 ms, against about 1.5 ms of reading a file.
FILES_PER_SWEEP = 256

_files_read = itertools.count(1)
_sweeping = False  # set by the CLI, whose collector is off by its own doing


def sweep_while_collector_off() -> None:
    """The CLI's: it has turned the collector off, and packer sweeps the cycles it leaves."""
    global _sweeping
    _sweeping = True


def _ours_to_sweep() -> bool:
    return _sweeping and not gc.isenabled()


def sweep() -> None:
    """Collect the cycles now (and freeze what survives) while the collector is off: for a
    large footer read once, which would otherwise stay for the rest of the run."""
    if _ours_to_sweep():
        gc.collect()
        gc.freeze()


def input_file_read() -> None:
    """Count one input file read to its end; sweep cycles after every ``FILES_PER_SWEEP``-th
    while the collector is off."""
    if next(_files_read) % FILES_PER_SWEEP == 0 and _ours_to_sweep():
        gc.collect()
        gc.freeze()
