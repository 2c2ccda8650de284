"""The ``packer`` command line: a thin typer layer over the Python API.

Exit codes: 0 ok, 1 data error (or problems found by verify), 2 bad options or unusable paths.
Every error is one line on stderr; no tracebacks.
"""
from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer
from rich.console import Console

from packer_cli.errors import PackerError
from packer_cli.spec import Algorithm, BadRecordPolicy, OverlongPolicy, PackSpec, SourceSpec

app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="Pack tokenized SFT samples into fixed-capacity THD packs; inspect and verify them.",
)
err = Console(stderr=True, highlight=False, soft_wrap=True)


@app.callback()
def _group() -> None:
    """packer: pack, inspect and verify THD training data."""


def fail(exc: PackerError) -> None:
    err.print(f"[bold red]error:[/] {exc}", markup=True) if err.is_terminal else print(f"error: {exc}", file=sys.stderr)
    raise typer.Exit(exc.exit_code)


def parse_size(text: str) -> int:
    """'256MB', '1G', '1048576' → bytes."""
    units = {"": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30}
    t = text.strip().upper().replace("IB", "B")
    num = t.rstrip("KMGB")
    try:
        return int(float(num) * units[t[len(num):]])
    except (ValueError, KeyError):
        raise typer.BadParameter(f"not a size: {text!r} (e.g. 256MB)") from None


@app.command("pack")
def pack_command(
    inputs: Annotated[list[str], typer.Argument(help="Input files, directories or globs (one stream, in order).")],
    out: Annotated[Optional[str], typer.Option("-o", "--out", help="Output directory.")] = None,
    pack_size: Annotated[int, typer.Option("--pack-size", "-C", help="Pack capacity in padded runtime tokens.")] = 4096,
    cp: Annotated[int, typer.Option(help="Context-parallel size.")] = 1,
    tp: Annotated[int, typer.Option(help="Tensor-parallel size.")] = 1,
    sp: Annotated[bool, typer.Option("--sp/--no-sp", help="Sequence parallelism.")] = False,
    pad_seq_to_mult: Annotated[Optional[int], typer.Option(help="Override the per-sequence alignment (a multiple of the layout's).")] = None,
    algorithm: Annotated[Algorithm, typer.Option(help="Assignment algorithm.")] = Algorithm.FFD,
    seed: Annotated[int, typer.Option(help="Seed for the pack shuffle and first-fit-shuffle.")] = 0,
    shuffle: Annotated[bool, typer.Option("--shuffle/--no-shuffle", help="Shuffle packs after planning.")] = True,
    overlong: Annotated[OverlongPolicy, typer.Option(help="Policy for sequences longer than the pack size.")] = OverlongPolicy.TRUNCATE,
    pad_to_max_length: Annotated[bool, typer.Option(help="Pad every pack's tail to exactly the pack size.")] = False,
    pad_cu_seqlens: Annotated[bool, typer.Option(help="Record static-shape metadata (needs --pad-to-max-length).")] = False,
    pad_id: Annotated[int, typer.Option(help="Token id used for alignment padding.")] = 0,
    tokens_field: Annotated[str, typer.Option(help="Field holding the token ids.")] = "input_ids",
    mask_field: Annotated[Optional[str], typer.Option(help="Force an input-aligned loss-mask field.")] = None,
    labels_field: Annotated[Optional[str], typer.Option(help="Force an HF-style labels field (-100 = ignored).")] = None,
    vocab_size: Annotated[Optional[int], typer.Option(help="Reject token ids >= this.")] = None,
    on_bad_record: Annotated[BadRecordPolicy, typer.Option(help="Stop on a bad record, or skip and count it.")] = BadRecordPolicy.ERROR,
    shard_size: Annotated[str, typer.Option(help="Approximate shard size.")] = "256MB",
    overwrite: Annotated[bool, typer.Option(help="Replace an existing OUT.")] = False,
    dry_run: Annotated[bool, typer.Option(help="Plan and print the summary; write nothing.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
) -> None:
    """Pack tokenized samples into fixed-capacity packs (native THD shards)."""
    from packer_cli.pipeline import pack
    from packer_cli.report import print_pack_summary

    spec = PackSpec(
        pack_size=pack_size, cp=cp, tp=tp, sp=sp, pad_seq_to_mult=pad_seq_to_mult, algorithm=algorithm,
        seed=seed, shuffle=shuffle, overlong=overlong, pad_to_max_length=pad_to_max_length,
        pad_cu_seqlens=pad_cu_seqlens, pad_id=pad_id,
    )
    source = SourceSpec(tokens_field=tokens_field, mask_field=mask_field, labels_field=labels_field,
                        vocab_size=vocab_size, on_bad_record=on_bad_record)
    try:
        summary = pack(inputs, out, spec, source, overwrite=overwrite, dry_run=dry_run,
                       shard_bytes=parse_size(shard_size), progress=not json_out,
                       warn=lambda msg: err.print(f"warning: {msg}", markup=False))
    except PackerError as exc:
        fail(exc)
    if json_out:
        import orjson

        sys.stdout.write(orjson.dumps(summary.to_dict(), option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print_pack_summary(summary)


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":  # pragma: no cover
    main()
