"""The ``packer`` command line: a thin typer layer over the Python API.

Exit codes: 0 ok, 1 data error (or problems found by verify), 2 bad options or unusable paths,
3 the output could not be written (disk full, I/O error), 74 stdout could not be written (the
run's own status stands when it failed), 130/143/129 interrupted by SIGINT/SIGTERM/SIGHUP (everything
unwound, nothing left behind), 141 stdout closed early (``packer ... | head``).
Every error is one line on stderr, bad options included; no tracebacks. The console script
enters through :mod:`packer_cli._entry` (Ctrl-C during start-up).
"""
from __future__ import annotations

import errno
import gc
import os
import signal
import sys
import warnings
from typing import Annotated, Optional

import orjson  # before any command installs its signal handlers: see main()
import typer
from rich.text import Text
from packer_cli._console import (Console, StdoutLost, guard_std_streams, one_line, quiet_stream, say, stdout_failure,
                                 stdout_takes_utf8)

from packer_cli._allocator import keep_freed_memory
from packer_cli._cycles import sweep_while_collector_off
from packer_cli._jit import CompileLog, light_cache_loads, log_compiles
from packer_cli.errors import (ConfigError, Interrupted, PackerError, PackerWarning, check_interrupted,
                               exception_chain, first_line, handling_signals, interrupted, late_signal, raise_interrupted,
                               out_of_memory, record_arrival_order, signal_received, stop_raising_interrupts)
from packer_cli.shards._atomic import STOPPING_SIGNALS
from packer_cli.shards.bridge import OutputFormat, ParquetEncoding, Split
from packer_cli.spec import Algorithm, BadRecordPolicy, OverlongPolicy, PackSpec, SourceSpec, SpillRead

# Help as click formats it (rich_markup_mode=None): typer's rich tables cut option names at the
# 80 columns a pipe or a small terminal has (``--pad-to-max-len…``, ``--parquet-encodi…``),
# where click's layout wraps the descriptions and keeps every name whole.
app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
    help="Pack tokenized SFT samples into fixed-capacity THD packs; inspect and verify them.",
)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _print_version(asked: bool) -> None:
    if asked:
        from packer_cli import __version__

        typer.echo(f"packer {__version__}")
        raise typer.Exit()


@app.callback()
def _group(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print packer's version and exit.")] = False,
) -> None:
    """packer: pack, inspect and verify THD training data."""


def fail(exc: PackerError) -> None:
    if err.is_terminal:
        say(Text.assemble(("error:", "bold red"), f" {one_line(str(exc))}"), err)  # the message as text: it holds paths
    else:
        say(f"error: {exc}")
    raise typer.Exit(exc.exit_code)


#: No size a file system or an address space can hold is larger (2**63 - 1: what off_t holds).
_LARGEST_SIZE = (1 << 63) - 1


def parse_size(text: str, option: str) -> int:
    """'256MB', '1G', '1048576' → bytes (binary units); ``option`` names the flag in the error."""
    units = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30,
             "GB": 1 << 30, "T": 1 << 40, "TB": 1 << 40}
    t = text.strip().upper().replace("IB", "B")
    num = t.rstrip("KMGTB")
    try:
        multiplier = units[t[len(num):]]
        try:
            number = int(num)  # exact: a float made 99999999999999999999999 ...999991611392 bytes
        except ValueError:
            number = float(num)  # '1.5K', '1e9'
        size = int(number * multiplier)
    except (ValueError, KeyError, OverflowError):  # OverflowError: 'inf'
        raise ConfigError(f"{option}: not a size: {text!r} (e.g. 256MB, 2GB)") from None
    if number < 0:  # -0.5 passed on as 0 bytes: --spill-memory took it, --shard-size named a 0 never given
        raise ConfigError(f"{option}: {text!r} is a negative size")
    if number > 0 and size == 0:  # 0.5 would pass on as 0 bytes, an error naming neither
        raise ConfigError(f"{option}: {text!r} is less than one byte")
    if size > _LARGEST_SIZE:
        raise ConfigError(f"{option}: {text!r} is more than {_LARGEST_SIZE:,} bytes")
    return size


@app.command("pack")
def pack_command(
    inputs: Annotated[list[str], typer.Argument(help="Input files, directories or globs (one stream, in order).")],
    out: Annotated[Optional[str], typer.Option("-o", "--out", help="Output directory.")] = None,
    pack_size: Annotated[int, typer.Option("--pack-size", "-C", help="Pack capacity in padded runtime tokens.")] = 4096,
    cp: Annotated[int, typer.Option(help="Context-parallel size.")] = 1,
    tp: Annotated[int, typer.Option(help="Tensor-parallel size.")] = 1,
    sp: Annotated[bool, typer.Option("--sp/--no-sp", help="Sequence parallelism.")] = False,
    pad_seq_to_mult: Annotated[Optional[int], typer.Option(help="Override the per-sequence alignment (a multiple of the layout's).")] = None,
    algorithm: Annotated[Algorithm, typer.Option(metavar="NAME", help="Assignment algorithm: ffd, bfd, first-fit-shuffle or sequential.")] = Algorithm.FFD,
    seed: Annotated[int, typer.Option(help="Seed for the pack shuffle and first-fit-shuffle.")] = 0,
    shuffle: Annotated[bool, typer.Option("--shuffle/--no-shuffle", help="Shuffle packs after planning.")] = True,
    overlong: Annotated[OverlongPolicy, typer.Option(help="Policy for sequences longer than the pack size.")] = OverlongPolicy.TRUNCATE,
    pad_to_max_length: Annotated[bool, typer.Option("--pad-to-max-length", help="Pad every pack's tail to exactly the pack size.")] = False,
    pad_cu_seqlens: Annotated[bool, typer.Option("--pad-cu-seqlens", help="Record static-shape metadata (needs --pad-to-max-length).")] = False,
    pad_id: Annotated[int, typer.Option(help="Token id used for alignment padding.")] = 0,
    refine: Annotated[bool, typer.Option("--refine/--no-refine", help="After ffd/bfd, re-fill non-full packs toward the L2 bound.")] = True,
    window: Annotated[Optional[int], typer.Option(metavar="N", help="ffd/bfd: plan each run of N input records on its own; packs never mix runs and keep their order (with --no-shuffle: the input order at run granularity, for curricula).", show_default=False)] = None,
    tokens_field: Annotated[str, typer.Option(help="Field holding the token ids.")] = "input_ids",
    mask_field: Annotated[Optional[list[str]], typer.Option(help="Force an input-aligned loss-mask field; repeated, a token is a target where every mask named is 1.")] = None,
    labels_field: Annotated[Optional[str], typer.Option(help="Force an HF-style labels field (-100 = ignored).")] = None,
    all_targets: Annotated[bool, typer.Option("--all-targets", help="Train on every token: read no supervision field (TRL's completion_only_loss=False).")] = False,
    vocab_size: Annotated[Optional[int], typer.Option(help="Reject token ids >= this.")] = None,
    on_bad_record: Annotated[BadRecordPolicy, typer.Option(help="Stop on a bad record, or skip and count it.")] = BadRecordPolicy.ERROR,
    shard_size: Annotated[str, typer.Option(help="Approximate shard size.")] = "256MB",
    spill_dir: Annotated[Optional[str], typer.Option(help="Existing directory for the temporary spill (about 2¼ bytes a token, read back at random; default: beside the output). Use local disk when OUT is on a network file system.")] = None,
    spill_memory: Annotated[Optional[str], typer.Option(help="Bytes of the spill to hold in memory instead of on disk (its first batches, up to this size; resident only as far as used); 0: all of it in the file. Default: 256MB, at most a quarter of the memory available (or of a container's room), less near an address-space limit.", show_default=False)] = None,
    spill_read: Annotated[SpillRead, typer.Option(help="How pass two reads the spill: random (a read per sequence; the page cache serves it), staged (copied into stages in one sequential pass first, each stage then read whole: for a spill larger than the page cache can hold, e.g. under a container memory limit), auto (staged when the spill exceeds the page cache available to it). Same output either way.")] = SpillRead.AUTO,
    direct_io: Annotated[Optional[bool], typer.Option("--direct-io/--buffered-io", help="Write the output with O_DIRECT, bypassing the page cache, or through it (same bytes either way). Default: O_DIRECT on local and parallel file systems (ext4, xfs, btrfs, Lustre, GPFS...), buffered elsewhere (NFS, SMB, FUSE, tmpfs).", show_default=False)] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing OUT.")] = False,
    dry_run: Annotated[bool, typer.Option(help="Plan and print the summary; write nothing.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
    out_format: Annotated[OutputFormat, typer.Option("--format", help="Output format: native shards, or Megatron-Bridge's Parquet layout.")] = OutputFormat.NATIVE,
    split: Annotated[Optional[Split], typer.Option(help="megatron-bridge: which split file to write (default training).")] = None,
    eos_id: Annotated[Optional[int], typer.Option(help="megatron-bridge: end-of-sequence id for alignment padding (inferred when every sample ends with one id).")] = None,
    row_group_size: Annotated[Optional[int], typer.Option(help="megatron-bridge: packs per Parquet row group (default: about 1 MiB of tokens, at most 500).")] = None,
    parquet_encoding: Annotated[Optional[ParquetEncoding], typer.Option(metavar="NAME", help="megatron-bridge: plain-zstd (default, any reader), plain-snappy (Bridge's codec, largest) or split-zstd (smallest for random-looking ids, larger than plain-zstd on real text; readers need Arrow >= 16).")] = None,
) -> None:
    """Pack tokenized samples into fixed-capacity packs (native THD shards, or Megatron-Bridge's Parquet layout)."""
    from packer_cli.pipeline import pack
    from packer_cli.report import print_pack_summary

    spec = PackSpec(
        pack_size=pack_size, cp=cp, tp=tp, sp=sp, pad_seq_to_mult=pad_seq_to_mult, algorithm=algorithm,
        seed=seed, shuffle=shuffle, overlong=overlong, pad_to_max_length=pad_to_max_length,
        pad_cu_seqlens=pad_cu_seqlens, pad_id=pad_id, refine=refine, window=window,
    )
    source = SourceSpec(tokens_field=tokens_field, mask_field=mask_field[0] if mask_field else None,
                        also_mask_fields=tuple(mask_field[1:]) if mask_field else (), labels_field=labels_field,
                        all_targets=all_targets,
                        vocab_size=vocab_size, on_bad_record=on_bad_record)
    compiles = _kernels_ready()
    try:
        _no_empty_paths([("--out", out), ("--spill-dir", spill_dir)] + [("INPUTS", path) for path in inputs])
        output = _bridge_output(out_format, split, eos_id, row_group_size, parquet_encoding)
        summary = pack(inputs, out, spec, source, overwrite=overwrite, dry_run=dry_run,
                       shard_bytes=parse_size(shard_size, "--shard-size"), progress=not json_out,
                       warn=lambda msg: say(f"warning: {msg}", err), output=output,
                       spill_dir=spill_dir, spill_memory=None if spill_memory is None else parse_size(spill_memory, "--spill-memory"), direct_io=direct_io,
                       spill_read=spill_read.value, compile_ahead=True)
    except PackerError as exc:
        _fail_audit(exc, json_out, out)
    check_interrupted()  # a run the user stopped prints no summary
    if (late := late_signal()) is not None:  # it came once the output was in place: the run is done
        say(f"warning: {_SIGNAL_WORDS.get(late, 'terminated')} after {out} was complete: the output is kept")
    if json_out:  # ok and exit_code as a failure's document has them: a job tests one key either way
        _print_json({"ok": True, "exit_code": 0, **summary.to_dict()})
    else:
        print_pack_summary(summary)
        if summary.output:
            from packer_cli.shards.bridge import describe

            print(describe(summary.output))
    _say_compiled(compiles)


def _print_json(doc: dict) -> None:
    try:
        text = orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode()
        if not text.isascii() and not stdout_takes_utf8():  # escaped, still JSON (a backslash escape is not)
            raise TypeError
    except TypeError:  # a string orjson refuses: a path of argv bytes that are not UTF-8 (lone surrogates)
        import json

        text = json.dumps(doc, indent=2, ensure_ascii=True, default=str)
    sys.stdout.write(text + "\n")


def _print_failure_json(doc: dict) -> None:
    """A failure's document: a stdout that cannot take it changes nothing about the failure
    (its line still goes to stderr, its status stands; main() says what stdout met)."""
    try:
        _print_json(doc)
    except StdoutLost:
        pass


def _bridge_output(out_format: OutputFormat, split, eos_id, row_group_size, parquet_encoding=None):
    """The BridgeOutput for ``--format megatron-bridge``; its options are errors otherwise."""
    if out_format is OutputFormat.NATIVE:
        given = [name for name, v in (("--split", split), ("--eos-id", eos_id), ("--row-group-size", row_group_size),
                                      ("--parquet-encoding", parquet_encoding)) if v is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to "
                              "--format megatron-bridge")
        return None
    from packer_cli.shards.bridge_output import BridgeOutput

    encoding = {} if parquet_encoding is None else {"parquet_encoding": parquet_encoding.value}  # else BridgeOutput's default
    return BridgeOutput(split=(split or Split.TRAINING).value, eos_id=eos_id, row_group_size=row_group_size,
                        **encoding).validate()


def _splits_to_audit(out: str, split: Optional[Split]) -> list[Optional[str]]:
    """The split(s) to inspect or verify: the one asked for, else every split of a
    Megatron-Bridge layout, else the output itself (None). Asking for a split that was never
    written to a Bridge layout is a :class:`ConfigError`, as ``--split`` on a native output is."""
    from packer_cli.shards.bridge import is_bridge_dir, packer_splits_in, split_has_files, splits_in
    from packer_cli.shards.format import METADATA_FILE

    bridge = os.path.isdir(out) and not os.path.exists(os.path.join(out, METADATA_FILE)) and is_bridge_dir(out)
    if split is not None:
        if bridge and not split_has_files(out, split.value):
            raise ConfigError(f"{out} holds no {split.value!r} split (it holds: {', '.join(packer_splits_in(out))}); "
                              "pass one of those to --split, or none for all")
        return [split.value]
    # splits are found by their metadata (one split's audit reports another's missing one, and
    # names a data file with neither of packer's files as not verified); a layout none of whose
    # splits has metadata is audited by its manifests, to say so
    return (splits_in(out) or packer_splits_in(out)) if bridge else [None]


def _print_reports(reports: dict, json_out: bool, console: Console) -> None:
    """One report as itself; several (one per Bridge split) keyed by split name."""
    check_interrupted()  # a run the user stopped prints no verdict
    if json_out:
        _print_json(next(iter(reports.values())).to_dict() if len(reports) == 1 else {
            "splits": {name: r.to_dict() for name, r in reports.items()}})
        return
    for name, report in reports.items():
        if len(reports) > 1:
            console.rule(f"split: {name}")
        console.print(report)


SplitOption = Annotated[Optional[Split], typer.Option(
    help="One split of a Megatron-Bridge layout (default: every split there).")]


@app.command("inspect")
def inspect_command(
    out: Annotated[str, typer.Argument(help="Output directory written by `packer pack`.")],
    pack: Annotated[Optional[int], typer.Option("--pack", help="Also show pack N in detail (0-based).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout (docs/AUDIT.md).")] = False,
    split: SplitOption = None,
) -> None:
    """Summarize packed shards: counts, padding, bounds, distributions and attention work."""
    from packer_cli.audit import InconsistentOutput, inspect_output

    check_interrupted()
    compiles = _kernels_ready()
    try:
        _no_empty_paths([("OUT", out)])
        reports = {s: inspect_output(out, pack=pack, split=s) for s in _splits_to_audit(out, split)}
    except InconsistentOutput as exc:
        _fail_audit(exc, json_out, out, findings=[f.to_dict() for f in exc.findings])
    except PackerError as exc:
        _fail_audit(exc, json_out, out)
    except MemoryError as exc:  # pyarrow's ArrowMemoryError too
        _fail_audit(out_of_memory(out, exc), json_out, out)
    _print_reports(reports, json_out, Console(soft_wrap=True))  # OUT's path whole in the title
    _say_compiled(compiles)


#: Said on stderr, where it is a terminal, as the first of packer's kernels starts compiling (a cache miss).
COMPILING_NOTICE = ("compiling packer's kernels for this machine: first use after an install or upgrade, up to "
                    "about half a minute a command, once; later runs load them from the cache")


def _kernels_ready() -> CompileLog | None:
    """Load cached kernels the light way; on a terminal, say so when one must be compiled
    instead: a first run otherwise sat at 'reading 0/?' for half a minute with no word why.
    Not where stderr is a file or a pipe: what a script or a job reads there stays as it was (an
    error is still its one line), and a log shows the time in the run's own figures."""
    light_cache_loads()
    try:
        terminal = sys.stderr.isatty()
    except (AttributeError, ValueError):  # no stderr, or a closed one
        terminal = False
    if not terminal:
        return None
    return log_compiles(lambda: say(COMPILING_NOTICE, err))  # above the progress bars, where they are live


def _say_compiled(log: CompileLog | None) -> None:
    """After a command that compiled kernels: how many, and what they cost (part of its run time)."""
    if log is not None and log.kernels:
        say(f"compiled {log.kernels} of packer's kernels in {log.seconds:.1f} s (included in this run's time; "
            "cached for later runs)", err)


def _no_empty_paths(given: list[tuple[str, Optional[str]]]) -> None:
    """An empty path given for an option or argument is a ConfigError naming it as typed (the API
    it reaches names its own parameter: 'spill_dir: an empty path')."""
    for name, value in given:
        if value == "":
            raise ConfigError(f"{name}: an empty path ('')")


def _fail_audit(exc: PackerError, json_out: bool, out: str, **extra) -> None:
    """:func:`fail`; with ``--json``, stdout gets ``{out, ok: false, exit_code, error, ...}`` too,
    so a pipeline reading stdout gets a document whatever went wrong, not an empty page."""
    if json_out:
        _print_failure_json({"out": out, "ok": False, "exit_code": exc.exit_code, "error": str(exc), **extra})
    fail(exc)


@app.command("verify")
def verify_command(
    out: Annotated[str, typer.Argument(help="Output directory written by `packer pack`.")],
    source: Annotated[Optional[list[str]], typer.Option(
        "--source", help="Original input (file, directory or glob; repeat for several): every sample must be accounted for.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout (docs/AUDIT.md).")] = False,
    limit: Annotated[int, typer.Option(help="Problems listed per check (all are counted).")] = 20,
    split: SplitOption = None,
) -> None:
    """Check shards, metadata and (with --source) the inputs; exit 0 ok, 1 problems, 2 unusable."""
    from packer_cli.audit import verify_output

    check_interrupted()
    try:
        _no_empty_paths([("OUT", out)] + [("--source", path) for path in source or ()])
        splits = _splits_to_audit(out, split)
    except PackerError as exc:
        _fail_audit(exc, json_out, out)
    if source and len(splits) > 1:
        _fail_audit(ConfigError(f"{out} holds the splits {', '.join(splits)}; with --source name the one it fed "
                                "(--split)"), json_out, out)
    compiles = _kernels_ready()
    try:
        reports = {s: verify_output(out, sources=source, limit=limit, split=s) for s in splits}
    except PackerError as exc:
        _fail_audit(exc, json_out, out)
    except MemoryError as exc:  # pyarrow's ArrowMemoryError too
        _fail_audit(out_of_memory(out, exc), json_out, out)
    verdict = max(r.exit_code for r in reports.values())
    try:
        _print_reports(reports, json_out, Console(highlight=False, soft_wrap=True))
    except StdoutLost as exc:
        if exc.reader_gone or not verdict:
            raise
        # problems found stay exit 1 (main() says what stdout met): only a success becomes 74
    _say_compiled(compiles)
    raise typer.Exit(verdict)


def _signal_behind(exc: BaseException) -> Interrupted | None:
    """The signal an exception stands for, if any.

    The handler raises wherever the main thread is; when that is inside C code calling back
    into Python (numba's dispatcher loading a cached kernel, say), the C code reports
    ``SystemError: ... returned a result with an exception set``, with ours as its context.
    Some replace it with an error of their own that does not carry it: importing numba, a
    Ctrl-C 0.2 s in ended in ``ImportError: numba._devicearray failed to import`` and a
    traceback (1 run in 150). An unexpected error after a signal is the signal's doing.
    """
    found = next((cause for cause in exception_chain(exc) if isinstance(cause, Interrupted)), None)
    if found is None and (signum := signal_received()) is not None:
        return Interrupted(signum)
    return found


def _is_usage_error(exc: BaseException) -> bool:
    # click's exception classes, wherever this typer takes click from (vendored or not)
    return any(cls.__name__ == "ClickException" for cls in type(exc).__mro__)


def _usage_line(exc) -> str:
    """A bad option or argument as one line, with where to look: the subcommand's help, also
    for the errors click raises without a context (an option missing its value, a flag given
    one), where the subcommand is the first argument naming one."""
    if getattr(exc, "ctx", None) is not None:
        command = exc.ctx.command_path
    else:
        names = {c.name for c in app.registered_commands}
        given = next((a for a in sys.argv[1:] if a in names), None)
        command = f"packer {given}" if given else "packer"
    return f"error: {exc.format_message()} (see '{command} --help')"


_SIGNAL_WORDS = {signal.SIGINT: "interrupted", getattr(signal, "SIGHUP", -1): "hung up"}


def _report_signal(exc: Interrupted) -> int:
    """Say why the command stopped; 128 + the signal's number, as a shell reports a killed command."""
    say(f"error: {_SIGNAL_WORDS.get(exc.signum, 'terminated')}")
    return 128 + exc.signum


def _quiet_about_interrupts(hook):
    """``sys.unraisablehook`` that keeps quiet about an interrupt raised inside a finalizer (a
    ``__del__`` that ran when the signal came): Python would print it as "Exception ignored"
    with a traceback and go on; :func:`check_interrupted` raises it again at the next check.
    Once a signal has stopped the command it also keeps quiet about the finalizers of what the
    signal cut short, which may fail (seen: llvmlite closing a half-closed module reference
    raised AttributeError, printed after ``error: interrupted``)."""

    def unraisable(event) -> None:
        if not (isinstance(event.exc_value, Interrupted) or interrupted()):
            hook(event)

    return unraisable


def _quiet_tracebacks_after_a_signal(hook):
    """``sys.excepthook`` that keeps quiet once a signal has stopped the command. Native code
    that must not let an exception through prints it with ``PyErr_Print`` and goes on, and
    that calls this hook: a Cython ``noexcept`` callback does, so a Ctrl-C landing in the
    import one of pyarrow 14's makes printed the handler's traceback above ``error: interrupted``
    (1 of 250 Ctrl-Cs 0.1-0.4 s into ``pack`` of a Parquet file). The command reports the
    signal itself; an exception that reaches the hook otherwise is printed as before."""

    def excepthook(exc_type, exc_value, exc_traceback) -> None:
        if not (isinstance(exc_value, Interrupted) or interrupted()):
            hook(exc_type, exc_value, exc_traceback)

    return excepthook


def _one_line_warnings(show):
    """``warnings.showwarning`` that prints packer's own warnings as one ``warning:`` line, as
    the commands' other warnings, instead of Python's file, line and source; others as before.

    Once a signal has stopped the command, other libraries' warnings are dropped: they come
    from what the signal cut short, and the user asked for nothing but ``error: interrupted``.
    (Seen: Ctrl-C landing in a Cython extension's import, pyarrow 14's, which then warns
    "Cython module failed to patch module with custom type" on its way out.)"""

    def showwarning(message, category, filename, lineno, file=None, line=None) -> None:
        if issubclass(category, PackerWarning):
            say(f"warning: {message}", err)
        elif not interrupted():
            show(message, category, filename, lineno, file, line)

    return showwarning


def _single_threaded_blas() -> None:
    """One OpenBLAS thread for this process, unless the user chose otherwise; effective only
    before numpy loads, which importing this module does not do."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def main() -> None:
    """Console-script entry point.

    The work is complete (files closed, output renamed) when a command returns, so the
    process leaves with ``os._exit`` after flushing: tearing down numba's and pyarrow's
    module state at interpreter shutdown costs ~0.15 s per run and achieves nothing.

    For the same reason a command runs with the cyclic garbage collector off: its full passes
    over the objects numba and pyarrow create while loading cost ~0.1 s a start, and a command
    makes little cyclic garbage (a ``pack`` run leaves about 1,300 objects in cycles, at 118M
    tokens as at 590M). Reference counting still frees everything else as it goes. The one
    cycle made per input file (pyarrow's, holding each Parquet footer) is swept every 256
    files (:mod:`packer_cli._cycles`): 5,000 files had held 0.4 GB.

    No command does linear algebra, so OpenBLAS (loaded with numpy) gets one thread: its
    worker threads otherwise spin in ``sched_yield`` after start-up, measured at ~0.2 s of CPU
    per ``pack`` run (perf stat, 4 alternating runs each) taken from the decode and gather
    threads. A value the user set is kept.

    glibc's allocator keeps freed memory for reuse (:mod:`packer_cli._allocator`): by its
    defaults every large array freed is unmapped and the next one faulted in and zeroed anew.

    Each command loads packer's cached kernels without numba's compiler set-up
    (:mod:`packer_cli._jit`): ~0.09 s of every start.

    orjson is imported with this module, before the handlers are installed: its extension's
    initialization imports Python modules (``json``; ``uuid``, ``zoneinfo``... in older
    releases) and crashes the process (SIGSEGV) when one of those imports raises, as the
    handler's exception does when a signal lands there (seen with orjson 3.9, whose
    initialization imports more: 4 of 460 Ctrl-Cs 0.15-0.45 s into ``pack`` crashed at the lowest
    versions packer accepts, in orjson's import where traced; then 1 of 700, in a kernel load:
    see :func:`packer_cli.errors.interrupts_deferred`; then 0 of 400).
    """
    keep_freed_memory()
    _single_threaded_blas()
    _std_streams_present()
    guard_std_streams()
    gc.disable()
    sweep_while_collector_off()
    handling_signals()
    record_arrival_order()
    for signum in STOPPING_SIGNALS:  # SIGHUP too: a closed terminal, a dropped ssh session
        if signal.getsignal(signum) is not signal.SIG_IGN:  # e.g. SIGINT in a background shell job, nohup
            signal.signal(signum, raise_interrupted)
    sys.unraisablehook = _quiet_about_interrupts(sys.unraisablehook)
    sys.excepthook = _quiet_tracebacks_after_a_signal(sys.excepthook)
    warnings.showwarning = _one_line_warnings(warnings.showwarning)
    try:
        code = _run_command()
    except Interrupted as exc:  # it came before the command's own handling began
        code = _report_signal(exc)
    if "PacifyFlushWrapper" in type(sys.stdout).__name__:  # click met the closed pipe and exited 1 (8.2+: _Pacify…)
        code = _reader_gone()
    stop_raising_interrupts()  # the command is over: nothing would catch a signal in the flush
    try:
        sys.stdout.flush()
    except (StdoutLost, BrokenPipeError):  # a reader that left after the command was done: its verdict stands
        quiet_stream(1)
    sys.stderr.flush()  # guarded: an error there makes it /dev/null
    os._exit(_answer_stdout_failure(code))


#: Exit status when stdout's reader went away mid-command (a shell reports a process killed by
#: SIGPIPE so: 128 + 13); the command's own verdict was never delivered.
EXIT_READER_GONE = 141

#: Exit status of a command that succeeded but could not write its report on stdout (a full
#: disk under ``> report.json``, an I/O error): ``EX_IOERR`` of sysexits.h.
EXIT_STDOUT_FAILED = 74


def _answer_stdout_failure(code: int) -> int:
    """A write to stdout that failed other than by its reader leaving (that ended the command
    quietly: :func:`_reader_gone`) is said in one line; it turns a success into
    :data:`EXIT_STDOUT_FAILED`, and a failure's own status stands."""
    failure = stdout_failure()
    if failure is None or failure.errno == errno.EPIPE:
        return code
    say(f"error: cannot write to stdout: {failure}")
    return EXIT_STDOUT_FAILED if code == 0 else code


def _std_streams_present() -> None:
    """Run with stdout or stderr closed (``>&-``), Python leaves them None and every print
    failed with a traceback, or the command exited 1 before it began: write to /dev/null."""
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")  # takes the lowest free descriptor: 1 itself
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")


def _reader_gone() -> int:
    """stdout's reader closed the pipe (``packer ... | head``): send what is left to /dev/null,
    so no later write or the final flush raises again, and return :data:`EXIT_READER_GONE`."""
    quiet_stream(1)
    return EXIT_READER_GONE


def _run_command() -> int:
    """Run the command line's command; its exit code, every failure reported in one line."""
    try:
        # not standalone: bad options come back as exceptions, to be reported in one line. The
        # click command is called directly, not `app()`: that replaces `sys.excepthook` with
        # typer's, which (pretty exceptions being off) only forwards to the hook typer found at
        # its import, the interpreter's, so main()'s hook would never be called
        returned = typer.main.get_command(app)(standalone_mode=False)
        check_interrupted()  # one whose exception was lost late in the command
        code = returned if isinstance(returned, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            say(exc.code)
    except Interrupted as exc:
        code = _report_signal(exc)
    except (StdoutLost, BrokenPipeError) as exc:  # stdout's reader went away (`packer inspect OUT --json | head -1`)
        code = _reader_gone() if getattr(exc, "reader_gone", True) else EXIT_STDOUT_FAILED  # said by main()
    except Exception as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `packer`: the help, on stderr as click shows it
            exc.show()
            code = 2
        elif _is_usage_error(exc) or isinstance(exc, PackerError):  # the latter raised before the command's
            line = _usage_line(exc) if _is_usage_error(exc) else f"error: {exc}"  # own handling: its imports
            if "--json" in sys.argv[1:]:  # a pipeline reading stdout gets a document here too
                _print_failure_json({"out": None, "ok": False, "exit_code": exc.exit_code,
                                     "error": line.removeprefix("error: ")})
            say(line)
            code = exc.exit_code
        elif (signalled := _signal_behind(exc)) is not None:
            code = _report_signal(signalled)
        elif _out_of_memory_loading(exc):
            say(f"error: out of memory loading packer's libraries: {first_line(exc)} (an address-space limit, "
                "ulimit -v, or the node's memory)")
            code = 3
        else:
            raise  # a bug: its traceback is what a report needs
    return code


def _out_of_memory_loading(exc: BaseException) -> bool:
    """A command's imports failed for memory: a shared library whose segments could not be
    mapped (``ImportError: libarrow.so...: failed to map segment``, under ``ulimit -v``), or
    Python's own ``MemoryError`` there (raised inside an import: ``inspect`` building a huge
    pack had been reported as loading libraries)."""
    if isinstance(exc, MemoryError):
        return _raised_importing(exc)
    text = str(exc).lower()
    return isinstance(exc, ImportError) and ("failed to map segment" in text or "cannot allocate memory" in text)


def _raised_importing(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while a module was being imported (a frame of importlib's)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        tb = tb.tb_next
    return False


if __name__ == "__main__":  # pragma: no cover
    main()
