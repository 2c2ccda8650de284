"""Human-readable summaries (rich tables) of what the API returns."""
from __future__ import annotations

from packer_cli._console import Console, one_line
from packer_cli.errors import counted
from packer_cli.plan.bounds import usable_capacity
from rich.console import Group
from rich.table import Table
from rich.text import Text


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def window_label(spec: dict) -> str:
    """' in windows of N records' for a windowed plan (``--window``), else '' (a damaged
    metadata.json's value, which verify reports, is shown as it is)."""
    window = spec.get("window")
    if window is None:
        return ""
    return f" in windows of {window:,} records" if type(window) is int else f" window={window!r}"


def pack_summary_table(summary) -> Table:
    c, q, s = summary.counts, summary.quality, summary.spec
    table = Table(show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    rows = [
        ("spec", f"C={s['pack_size']} m={s['pad_seq_to_mult']} CP={s['cp']} TP={s['tp']} "
                 f"SP={'on' if s['sp'] else 'off'} {s['algorithm']}{window_label(s)} seed={s['seed']}"),
        ("records read", f"{c['records']:,}"),
        ("targets", _targets_line(summary.source)),
        *_padding_rows(summary.source),
        ("samples packed", f"{c['samples_packed']:,}"),
        ("sequences", f"{c['sequences']:,}"),
        ("packs", f"{c['packs']:,}"),
        ("runtime tokens", f"{c['runtime_tokens']:,}"),
        ("target tokens", f"{c['target_tokens']:,}"),
        ("efficiency (real / packs·C)", _pct(q["efficiency"])),
        (lower_bound_label(s), f"{q['lower_bound']:,} / +{q['gap_to_lower_bound']} ({q['gap_to_lower_bound_pct']:.3f}%)"),
        ("L2 bound / gap", f"{q['l2_bound']:,} / +{q['gap_to_l2']} ({q['gap_to_l2_pct']:.3f}%)"),
        ("alignment padding", f"{c['alignment_padding']:,} ({_pct(c['alignment_padding'] / max(1, c['packs'] * s['pack_size']))})"),
        ("tail padding", f"{c['tail_padding']:,} ({_pct(c['tail_padding'] / max(1, c['packs'] * s['pack_size']))})"),
        (f"over-long ({c['overlong']['policy']})",
         f"{counted(c['overlong']['samples'], 'sample')}, {counted(c['overlong']['tokens_lost'], 'token')} / "
         f"{counted(c['overlong']['target_tokens_lost'], 'target')} lost"),
        ("dropped (too short / over-long)", f"{c['too_short_dropped']:,} / {c['overlong']['dropped']:,}"),
        ("bad records skipped", f"{c['bad_records']:,}"),
        ("samples without targets", f"{c['no_target_samples']:,}"),
    ]
    if summary.spill:
        rows.append(("spill read back", _spill_line(summary.spill)))
    if summary.disk:
        d = summary.disk
        shards = "" if d["output_bytes"] is None else f", shards {byte_size(d['output_bytes'])}"
        stages = f" (+ {byte_size(d['stage_bytes'])} staged)" if d.get("stage_bytes") else ""
        rows.append(("disk needed (estimated)", f"spill {byte_size(d['spill_disk_bytes'])}{stages}{shards}"))
    if summary.seconds:
        t = summary.seconds
        rows.append(("time (read / plan / write)",
                     f"{t['total']:.2f} s ({t['read']:.2f} / {t['plan']:.2f} / {t['write']:.2f})"))
    for what, value in rows:  # field names are the user's: text, never markup, one line a cell
        table.add_row(Text(one_line(what)), Text(one_line(value)))
    return table


def lower_bound_label(spec: dict) -> str:
    """The bound row's name: over C, or over C′ = ⌊C/m⌋·m where m does not divide C (the
    bounds are C′'s then)."""
    C, m = spec.get("pack_size"), spec.get("pad_seq_to_mult")
    if type(C) is int and type(m) is int and 1 <= m <= C and C % m:
        return f"lower bound ⌈Σp/C′⌉ (C′ = {usable_capacity(C, m)}) / gap"
    return "lower bound ⌈Σp/C⌉ / gap"


def _targets_line(source: dict) -> str:
    """Where the training targets came from: the field read, or every token."""
    sup = source["supervision"]
    if sup["kind"] == "all":
        return "every token (no supervision field read)"
    kind = {"mask": "loss mask", "labels": "HF labels", "answer": "answer start"}[sup["kind"]]
    also = source.get("also_mask_fields") or ()
    if also:  # a target where every mask is 1
        return "loss masks " + " and ".join(f"'{name}'" for name in (sup["field"], *also))
    return f"{kind} '{sup['field']}'"


def _padding_rows(source: dict) -> list[tuple[str, str]]:
    """The padding mask's row, when the records have one."""
    if not source.get("attention_field"):
        return []
    return [(f"padding dropped ({source['attention_field']})", f"{source.get('padding_dropped', 0):,} tokens")]


def byte_size(n: int) -> str:
    """``n`` bytes for a reader: GB from 1 GB, else MB."""
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def _spill_line(spill: dict) -> str:
    """How pass two read the spill, how much of it lay in memory, and (for ``auto``) against what room."""
    size = byte_size(spill["bytes"])
    if spill.get("memory_bytes"):
        size += ", all in memory" if spill["memory_bytes"] == spill["bytes"] else \
            f", {byte_size(spill['memory_bytes'])} of it in memory"
    how = f"staged, {spill['stages']:,} stages" if spill["read"] == "staged" else "at random"
    room = f", page cache room {byte_size(spill['room'])}" if "room" in spill else ""
    return f"{how} ({size}{room})"


class TitleLine:
    """A report's title naming OUT, as a line of its own above its table. A table's title wraps
    at the table's width, which broke a long path across lines padded with spaces where the
    console had room for it, so it no longer pasted back as one. Printed with soft wrapping (as
    the CLI prints) the line is whole and the terminal wraps it; otherwise it folds at the
    console's width. OUT is text, never markup ("run[v2]" is no style), its control characters
    escaped (a newline in OUT's name broke the line)."""

    def __init__(self, title: str):
        self.title = title

    def __rich_console__(self, console, options):
        yield Text(one_line(self.title), style="table.title", overflow="ignore" if options.no_wrap else "fold")


def print_pack_summary(summary, console: Console | None = None) -> None:
    title = "packer pack — dry run (nothing written)" if summary.dry_run else f"packer pack → {summary.out}"
    (console or Console(soft_wrap=True)).print(Group(TitleLine(title), pack_summary_table(summary)))
