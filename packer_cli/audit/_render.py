"""Rich renderables for the audit reports: summary tables and histograms drawn with blocks."""
from __future__ import annotations

from rich.console import Group
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from packer_cli._console import one_line
from packer_cli.audit._histogram import buckets
from packer_cli.errors import counted
from packer_cli.report import TitleLine, lower_bound_label, window_label

BLOCKS = " ▏▎▍▌▋▊▉█"


def bar(count: int, largest: int, width: int = 40) -> str:
    """A horizontal bar ``width`` cells long at ``largest``, with eighth-cell resolution."""
    eighths = round(8 * width * count / largest) if largest else 0
    if count and not eighths:
        eighths = 1
    return "█" * (eighths // 8) + (BLOCKS[eighths % 8] if eighths % 8 else "")


class Histogram:
    """A histogram as a table of ``range │ bar │ count`` rows, sized when it is drawn: the bar
    takes what the labels leave of the width (at most ``BAR_CELLS``), so a narrow terminal
    shortens the bars and keeps every range and count (a fixed bar left them no room)."""

    BAR_CELLS = 40

    def __init__(self, title: str, hist, label=lambda lo, hi: f"{lo:,}–{hi:,}" if hi > lo else f"{lo:,}",
                 n: int = 16):
        self.title = title
        self.rows = [(label(lo, hi), count) for lo, hi, count in buckets(hist, n)]

    def __rich_console__(self, console, options):
        largest = max((c for _, c in self.rows), default=0)
        label_cells = max((len(text) for text, _ in self.rows), default=0)
        count_cells = max((len(f"{c:,}") for _, c in self.rows), default=0)
        # three columns, one cell of padding each side of each
        width = max(1, min(self.BAR_CELLS, options.max_width - label_cells - count_cells - 6))
        table = Table(title=self.title, title_justify="left", show_header=False, box=None, padding=(0, 1))
        table.add_column("range", justify="right", style="bold", no_wrap=True)
        table.add_column("bar", style="cyan", no_wrap=True)
        table.add_column("count", justify="right", no_wrap=True)
        for text, count in self.rows:
            table.add_row(text, bar(count, largest, width), f"{count:,}")
        yield table


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:.2f}%"


def _count(value, word: str | None = None) -> str:
    """A recorded count with thousands separators, as every other count here, and its noun in
    the singular for one; ``n/a`` when absent."""
    if value is None:
        return "n/a" if word is None else f"n/a {word}s"
    if not isinstance(value, int) or isinstance(value, bool):
        return str(value) if word is None else f"{value} {word}s"
    return f"{value:,}" if word is None else counted(value, word)


def _stat(summary: dict, key: str) -> str:
    value = summary[key]
    return "n/a" if value is None else (f"{value:,}" if isinstance(value, int) else f"{value:,.1f}")


def summary_table(report, d: dict) -> Table:
    s, t, q, r = d["spec"], d["totals"], d["quality"], d["recorded"]
    spp = d["sequences_per_pack"]
    table = Table(show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    over = r.get("overlong") if isinstance(r.get("overlong"), dict) else {}
    gap = lambda b, g, p: "n/a" if b is None else f"{b:,} / +{g:,} ({p:.3f}%)"  # noqa: E731
    rows = [
        ("spec", f"C={s.get('pack_size')} m={s.get('pad_seq_to_mult')} CP={s.get('cp')} TP={s.get('tp')} "
                 f"SP={'on' if s.get('sp') else 'off'} {s.get('algorithm')}{window_label(s)} seed={s.get('seed')} "
                 f"overlong={s.get('overlong')}"),
        ("packs", f"{t['packs']:,}"),
        ("sequences", f"{t['sequences']:,}"),
        ("runtime tokens (real)", f"{t['runtime_tokens']:,}"),
        ("target tokens", f"{t['target_tokens']:,}"),
        ("alignment padding", f"{t['alignment_padding']:,} ({_pct(t['alignment_padding_pct'])})"),
        ("tail padding", f"{t['tail_padding']:,} ({_pct(t['tail_padding_pct'])})"),
        ("efficiency (real / packs·C)", _pct(100 * q["efficiency"])),
        ("fill (Σp / packs·C)", _pct(100 * q["fill"])),
        (lower_bound_label(s), gap(q["lower_bound"], q["gap_to_lower_bound"], q["gap_to_lower_bound_pct"])),
        ("Martello–Toth L2 / gap", gap(q["l2_bound"], q["gap_to_l2"], q["gap_to_l2_pct"])),
        ("sequences per pack min / median / max", " / ".join(_stat(spp, k) for k in ("min", "median", "max"))),
        (f"over-long ({over.get('policy', s.get('overlong'))})",  # the policy as the metadata has it
         f"{_count(over.get('samples'), 'sample')}, {_count(over.get('tokens_lost'), 'token')} lost, "
         f"{_count(over.get('extra_pieces'), 'extra piece')}"),
        ("dropped: too short / over-long", f"{_count(r.get('too_short_dropped'))} / {_count(over.get('dropped'))}"),
        ("bad records skipped", _count(r.get('bad_records'))),
    ]
    for what, value in rows:  # a damaged metadata.json's strings as text, escaped (one line a cell)
        table.add_row(Text(one_line(what)), Text(one_line(value)))
    return table


def attention_table(d: dict) -> Table:
    a = d["attention"]
    table = Table(title="attention work (Σ over packs)", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    ratio = "n/a" if a["overstatement"] is None else f"{a['overstatement']:.2f}×"
    share = "n/a" if a["linear_real_share"] is None else _pct(100 * a["linear_real_share"])
    table.add_row("Σ s_i² (real sequences)", f"{a['sum_sq_real']:,}")
    table.add_row("Σ T² (pack as one sequence)", f"{a['sum_sq_pack']:,}")
    table.add_row("pack-as-one-sequence overstates attention by", ratio)
    table.add_row("real-token share of linear-layer work (Σs / ΣT)", share)
    return table


#: A pack with more sequences than this is listed as aligned plain text, not a table: rich
#: measured and drew a table of a 2^24-token pack's 77k sequences in 33 s (0.4 ms a row).
DETAIL_TABLE_ROWS = 1000
_DETAIL_COLUMNS = ("seq", "source index", "offset", "start", "real", "padded", "targets")


def detail_table(detail) -> Table | Group:
    title = Text(one_line(f"pack {detail.pack} ({detail.shard} row {detail.row}, T={detail.pack_len:,})"),
                 style="table.title")
    columns = _detail_columns(detail)
    if len(detail.real_len) > DETAIL_TABLE_ROWS:
        widths = [max(len(name), *map(len, cells)) for name, cells in zip(_DETAIL_COLUMNS, columns)]
        lines = ["  ".join(name.rjust(w) for name, w in zip(_DETAIL_COLUMNS, widths))]
        lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in zip(*columns)]
        return Group(title, _PlainLines(lines))
    table = Table(title=title, title_justify="left")
    for name in _DETAIL_COLUMNS:
        table.add_column(name, justify="right")
    for row in zip(*columns):
        table.add_row(*row)
    return table


class _PlainLines:
    """Lines printed as they are (one segment each): a ``Text`` of 77k lines still took rich 7 s
    to split and measure."""

    def __init__(self, lines: list[str]):
        self.lines = lines

    def __rich_console__(self, console, options):
        width = max(1, options.max_width)
        for line in self.lines:
            for at in range(0, max(len(line), 1), width):  # folded, not cropped, on a narrow terminal
                yield Segment(line[at:at + width])
                yield Segment.line()


def _detail_columns(detail) -> list[list[str]]:
    """The pack's sequences, one list of cells a column (``_DETAIL_COLUMNS``)."""
    grouped = lambda values: [f"{v:,}" for v in values]  # noqa: E731
    return [[str(k) for k in range(len(detail.real_len))], [str(v) for v in detail.source_index],
            [str(v) for v in detail.source_offset], grouped(detail.start), grouped(detail.real_len),
            grouped(detail.padded_len), grouped(detail.target_tokens)]


def render_inspect(report) -> Group:
    d = report.to_dict()
    C = int(report.spec["pack_size"])
    # a bucket holds the loads lo..hi (inclusive, as the other histograms' labels): its fills are lo/C..hi/C
    fill = lambda lo, hi: f"{100 * lo / C:.1f}–{100 * hi / C:.1f}%" if hi > lo else f"{100 * lo / C:.1f}%"  # noqa: E731
    parts = [
        TitleLine(f"packer inspect → {report.out}"), summary_table(report, d), attention_table(d),
        Histogram("sequence length (real runtime tokens)", report.real_hist),
        Histogram("pack fill (Σp / C)", report.load_hist, label=fill),
        Histogram("sequences per pack", report.seqs_hist),
    ]
    if report.detail is not None:
        parts.append(detail_table(report.detail))
    return Group(*parts)


def render_verify(report) -> Group:
    # one line each, whatever a name or a record's text holds (control characters escaped)
    lines = [Text(one_line(f.line()), style="yellow" if f.severity == "warning" else "red") for f in report.findings]
    style = "bold green" if report.ok else "bold red"
    return Group(*lines, Text(one_line(report.verdict()), style=style))
