"""``metadata.schema``: metadata.json has every field a packer output records, with its type.

Values verify can recompute (counts, bounds, Bridge keys) are compared in ``_meta_checks``;
this check covers the shape of the document and the fields no recomputation reaches: a
missing or mistyped field is an error. Fields it does not know are accepted silently (a newer
packer or another output format may record more; a renamed field still shows up as missing).
Some values are facts about the run that the data cannot
confirm (``spec.seed``, ``packer_version``, input paths and sizes); docs/AUDIT.md lists them.
"""
from __future__ import annotations

import re

from packer_cli.audit.findings import FindingSink
from packer_cli.shards.bridge import BRIDGE_FORMAT, SPLITS
from packer_cli.shards.format import METADATA_FILE
from packer_cli.spec import BadRecordPolicy, PackSpec

SUPERVISION_KINDS = ("mask", "labels", "answer", "all")
INPUT_FORMATS = ("jsonl", "parquet", "arrow", "hf")
COUNT_KEYS = ("records", "bad_records", "too_short_dropped", "no_target_samples", "samples_packed", "sequences",
              "packs", "runtime_tokens", "padded_tokens", "target_tokens", "alignment_padding", "tail_padding")
OVERLONG_KEYS = ("samples", "tokens_lost", "target_tokens_lost", "extra_pieces", "dropped")
QUALITY_KEYS = ("efficiency", "fill", "lower_bound", "gap_to_lower_bound", "gap_to_lower_bound_pct", "l2_bound",
                "gap_to_l2", "gap_to_l2_pct")
BRIDGE_KEYS = ("dataset_max_seqlen", "max_samples_per_bin", "packing_factor", "packing_efficiency", "pack_size",
               "min_packed_seqlen")


def _count(v) -> bool:
    return type(v) is int and v >= 0


def _opt_str(v) -> bool:
    return v is None or isinstance(v, str)


def _also_masks_ok(v) -> bool:
    """``source.also_mask_fields``: the names of the masks applied with the supervision mask."""
    return isinstance(v, list) and all(isinstance(name, str) and name for name in v)


class _Checker:
    def __init__(self, sink: FindingSink):
        self.sink = sink

    def error(self, path: str, what: str) -> None:
        self.sink.add("metadata.schema", f"{path} {what}", shard=METADATA_FILE)

    def section(self, node, path: str, rules: dict) -> None:
        """Check ``node`` is an object whose keys satisfy ``rules`` (key → predicate or None)."""
        if not isinstance(node, dict):
            self.error(path, f"is {type(node).__name__}, expected an object")
            return
        for key, rule in rules.items():
            if key not in node:
                self.error(f"{path}.{key}", "is missing")
            elif rule is not None and not rule(node[key]):
                self.error(f"{path}.{key}", f"has an unexpected value {node[key]!r}")


def _optional(c: _Checker, node, path: str, rules: dict) -> None:
    """Check the keys of ``rules`` that ``node`` has (keys an older packer did not write)."""
    if isinstance(node, dict):
        c.section(node, path, {key: rule for key, rule in rules.items() if key in node})


def _spec_rules() -> dict:
    template = PackSpec(pack_size=1).as_dict()  # without the optional keys (_OPTIONAL_SPEC)
    rules = {}
    for key, value in template.items():
        kind = type(value)
        if value is None:  # optional integers (pad_seq_to_mult override)
            rules[key] = lambda v: v is None or type(v) is int
        else:
            rules[key] = lambda v, kind=kind: type(v) is kind
    return rules


def _inputs_ok(inputs) -> bool:
    return isinstance(inputs, list) and all(
        isinstance(e, dict) and isinstance(e.get("path"), str) and e.get("format") in INPUT_FORMATS
        and _count(e.get("bytes")) for e in inputs)


def _bad_ok(listed) -> bool:
    return isinstance(listed, list) and all(
        isinstance(e, dict) and isinstance(e.get("path"), str) and _count(e.get("row"))
        and (e.get("line") is None or _count(e.get("line"))) and isinstance(e.get("reason"), str) for e in listed)


#: spec keys recorded only when set (``window``: a windowed plan)
_OPTIONAL_SPEC = {"window": lambda v: type(v) is int and v >= 1}


def check_schema(meta: dict, sink: FindingSink) -> None:
    """Errors for missing or mistyped fields of metadata.json."""
    c = _Checker(sink)
    c.section(meta, "metadata", {
        "format": None, "format_version": None, "spec": None, "source": None, "counts": None, "quality": None,
        "bridge": None, "static": None, "bad_records": _bad_ok,
        "packer_version": lambda v: isinstance(v, str) and re.match(r"^\d+\.\d+", v) is not None,
    })
    if "spec" in meta:  # each section present must be an object (a missing one is reported above)
        c.section(meta["spec"], "spec", _spec_rules())
        _optional(c, meta["spec"], "spec", _OPTIONAL_SPEC)
    if "source" in meta:
        c.section(meta["source"], "source", {
            "inputs": _inputs_ok, "tokens_field": lambda v: isinstance(v, str) and v != "",
            "supervision": lambda v: isinstance(v, dict) and set(v) == {"kind", "field"}
            and v["kind"] in SUPERVISION_KINDS and _opt_str(v["field"]),
            "vocab_size": lambda v: v is None or (type(v) is int and v > 0),
            "on_bad_record": lambda v: v in [p.value for p in BadRecordPolicy],  # a list: v may be unhashable
        })
        _optional(c, meta["source"], "source", {"attention_field": _opt_str, "padding_dropped": _count,
                                                "also_mask_fields": _also_masks_ok})
    counts = meta.get("counts")
    if "counts" in meta:
        c.section(counts, "counts", {**{k: _count for k in COUNT_KEYS}, "overlong": None})
        if isinstance(counts, dict) and "overlong" in counts:
            c.section(counts["overlong"], "counts.overlong", {**{k: _count for k in OVERLONG_KEYS}, "policy": None})
    if meta.get("format") == BRIDGE_FORMAT:  # a Bridge split's own fields: its name and the EOS id its checks use
        c.section(meta, "metadata", {"split": lambda v: isinstance(v, str) and v in SPLITS})
        c.section(meta.get("output"), "output", {"eos_id": lambda v: v is None or (type(v) is int and v >= 0)})
    number = lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))  # noqa: E731
    for name, keys in (("quality", QUALITY_KEYS), ("bridge", BRIDGE_KEYS),
                       ("static", ("pack_len", "cu_seqlens_len", "max_seqlen"))):
        if name in meta:
            plan = {"plan": lambda v: isinstance(v, str) and v != ""} if name == "quality" else {}  # how it was planned
            c.section(meta[name], name, {**{k: number for k in keys}, **plan})
