"""Slow, obvious reference implementations used to test the compiled planner."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np


def _decreasing(lengths):
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def first_fit_decreasing(lengths, capacity):
    """Linear-scan FFD: each item (decreasing, ties by index) into the first pack with room."""
    lengths = [int(x) for x in lengths]
    room, out = [], [0] * len(lengths)
    for i in _decreasing(lengths):
        for p, r in enumerate(room):
            if r >= lengths[i]:
                break
        else:
            room.append(capacity)
            p = len(room) - 1
        room[p] -= lengths[i]
        out[i] = p
    return np.array(out, dtype=np.int64)


def best_fit_decreasing(lengths, capacity):
    """Linear-scan BFD: least remaining room that fits, ties to the lowest pack."""
    lengths = [int(x) for x in lengths]
    room, out = [], [0] * len(lengths)
    for i in _decreasing(lengths):
        best = -1
        for p, r in enumerate(room):
            if r >= lengths[i] and (best < 0 or r < room[best]):
                best = p
        if best < 0:
            room.append(capacity)
            best = len(room) - 1
        room[best] -= lengths[i]
        out[i] = best
    return np.array(out, dtype=np.int64)


def next_fit(lengths, capacity):
    out, pack, room = [], -1, 0
    for x in lengths:
        if x > room:
            pack, room = pack + 1, capacity
        room -= x
        out.append(pack)
    return np.array(out, dtype=np.int64)


def bridge_first_fit_shuffle(lengths, capacity, seed):
    """Transcription of Megatron-Bridge's create_packing_strategy(first_fit_shuffle)
    followed by fill_packing_strategy, on item indices instead of token rows.

    Uses the global legacy RNG exactly as Bridge does (np.random.seed, shuffle of
    a Python list, permutation per bucket), restoring the global state afterwards.
    """
    lengths = [int(x) for x in lengths]
    saved = np.random.get_state()
    try:
        np.random.seed(seed)
        # create_hist: buckets of items per length, in dataset order; histogram.
        sequences = {}
        for i, x in enumerate(lengths):
            sequences.setdefault(x, []).append(i)
        histogram = [0] * (capacity + 1)
        for x in lengths:
            histogram[x] += 1
        # create_packing_strategy: expand the histogram ascending, then first_fit_shuffle.
        all_seq_lens = []
        for x, count in enumerate(histogram):
            all_seq_lens.extend([x] * count)
        shuffled = all_seq_lens[:]
        np.random.shuffle(shuffled)
        bins, sums = [], []
        for x in shuffled:
            for b in range(len(bins)):
                if sums[b] + x <= capacity:
                    bins[b].append(x)
                    sums[b] += x
                    break
            else:
                bins.append([x])
                sums.append(x)
        # fill_packing_strategy: permute every non-empty bucket, ascending length.
        for x in range(capacity + 1):
            if sequences.get(x):
                perm = np.random.permutation(len(sequences[x]))
                sequences[x] = [sequences[x][j] for j in perm]
        pack_of_item = [0] * len(lengths)
        order = []
        for b, assignment in enumerate(bins):
            for x in assignment:
                item = sequences[x].pop()
                pack_of_item[item] = b
                order.append(item)
        assert all(not v for v in sequences.values())
    finally:
        np.random.set_state(saved)
    return np.array(pack_of_item, dtype=np.int64), np.array(order, dtype=np.int64)


def martello_toth_l2(lengths, capacity):
    """L2 evaluated set by set for every integer K in [0, C/2]."""
    lengths = [int(x) for x in lengths]
    if not lengths:
        return 0
    c = capacity
    best = 0
    for k in range(0, c // 2 + 1):
        j1 = [s for s in lengths if s > c - k]
        j2 = [s for s in lengths if c - k >= s and 2 * s > c]
        j3 = [s for s in lengths if 2 * s <= c and s >= k]
        extra = max(0, math.ceil((sum(j3) - (len(j2) * c - sum(j2))) / c))
        best = max(best, len(j1) + len(j2) + extra)
    return best


def exact_fill_rebuild(lengths, pool, capacity, threshold, max_triples, pair_words=None, balanced=False):
    """The refinement pass's exact-fill re-pack of ``pool``, by list scans: each pack takes the
    largest item, then the largest that leave at least ``threshold`` free, then closes its
    room with one item, the most balanced pair, or a third item (largest first, at most
    ``max_triples`` tried) and a pair, then best fit. Items of one size go in pool order.
    ``pair_words``: a pair's smaller size ``a`` is looked for only in the 64-size words from
    the one holding ``room // 2`` down, that many of them. ``balanced``: the greedy phase also
    takes nothing above ``room // k``, k = room / (mean length of the unplaced items), rounded
    to the nearest (half up). Returns the packs' item lists."""
    left = {}
    for k in pool:
        left.setdefault(int(lengths[k]), []).append(int(k))
    for items in left.values():
        items.reverse()  # pop() takes the first in pool order

    def sizes():
        return sorted((s for s, items in left.items() if items), reverse=True)

    def largest_at_most(x):
        return next((s for s in sizes() if s <= x), -1)

    def pair(room, held=None):
        count = {s: len(items) - (s == held) for s, items in left.items()}
        low = 1 if pair_words is None else max(1, ((room // 2 >> 6) - pair_words + 1) * 64)
        for a in sorted((s for s in count if low <= s <= room // 2), reverse=True):
            b = room - a
            if count[a] > 0 and count.get(b, 0) > (a == b):
                return [a, b]
        return None

    packs, todo = [], len(pool)
    while todo:
        pack, room = [], capacity

        def take(s):
            nonlocal room, todo
            pack.append(left[s].pop())
            room -= s
            todo -= 1

        take(largest_at_most(room))
        while todo and room > threshold:
            limit = room - threshold
            if balanced:
                unplaced = [s for s, items in left.items() for _ in items]
                k = math.floor(Fraction(room * len(unplaced), sum(unplaced)) + Fraction(1, 2))
                limit = min(limit, room // max(k, 1))
            s = largest_at_most(limit)
            if s < 1:
                break
            take(s)
        if todo and room > 0:
            close = [room] if left.get(room) else pair(room)
            if close is None:
                candidates = [s for s in sizes() if s <= room - 2][:max_triples]
                for c in candidates:
                    found = pair(room - c, held=c)
                    if found:
                        close = [c] + found
                        break
            for s in close or []:
                take(s)
        while todo and room > 0:
            s = largest_at_most(room)
            if s < 1:
                break
            take(s)
        packs.append(pack)
    return packs


def optimal_packs(lengths, capacity):
    """Exact minimum number of packs by exhaustive search (tiny inputs only)."""
    lengths = sorted((int(x) for x in lengths), reverse=True)
    n = len(lengths)
    if n == 0:
        return 0
    best = [n]

    def place(i, room):
        if len(room) >= best[0]:
            return
        if i == n:
            best[0] = len(room)
            return
        seen = set()
        for p in range(len(room)):
            if room[p] >= lengths[i] and room[p] not in seen:
                seen.add(room[p])
                room[p] -= lengths[i]
                place(i + 1, room)
                room[p] += lengths[i]
        room.append(capacity - lengths[i])
        place(i + 1, room)
        room.pop()

    place(0, [])
    return best[0]


def pack_layout(pack_of_item, placement):
    """(order, offsets) from a pack assignment and a placement sequence."""
    pack_of_item = np.asarray(pack_of_item)
    p = int(pack_of_item.max()) + 1 if len(pack_of_item) else 0
    groups = [[] for _ in range(p)]
    for i in placement:
        groups[pack_of_item[i]].append(int(i))
    order = list(itertools.chain.from_iterable(groups))
    offsets = np.cumsum([0] + [len(g) for g in groups])
    return np.array(order, dtype=np.int64), offsets.astype(np.int64)


def gather_packs(spill_tokens, spill_targets, sample_start, seq_sample, seq_offset, seq_len, seq_pad,
                 pack_seq_offsets, pad_id):
    """Obvious per-sequence gather (oracle for the compiled ``pread`` gather).

    Sequences are in output order; for each: its s input tokens then p − s ``pad_id``; the
    label-aligned mask (targets of tokens 1..s, then 0); its last label (token s); and each
    pack's physical offsets ``[0, p₀, p₀+p₁, …]``.
    """
    tokens, mask, last, cu = [], [], [], []
    for k in range(len(pack_seq_offsets) - 1):
        cu.append(0)
        pos = 0
        for i in range(pack_seq_offsets[k], pack_seq_offsets[k + 1]):
            src = int(sample_start[seq_sample[i]] + seq_offset[i])
            s, p = int(seq_len[i]), int(seq_pad[i])
            tokens += list(spill_tokens[src:src + s]) + [pad_id] * (p - s)
            mask += list(spill_targets[src + 1:src + s + 1]) + [0] * (p - s)
            last.append(int(spill_tokens[src + s]))
            pos += p
            cu.append(pos)
    return (np.asarray(tokens, dtype=np.int32), np.asarray(mask, dtype=np.uint8),
            np.asarray(last, dtype=np.int32), np.asarray(cu, dtype=np.int32))


def sequence_table(lengths, cap, m, policy):
    """Obvious per-sequence table (oracle for ``_sequences.build_items`` + ``Items.resolve``).

    Returns rows (sample, offset, s, p, spill start) in item order: every kept sample's first
    sequence in sample order, then the further pieces of split samples in sample order.
    """
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + int(n))
    first, extra = [], []
    for k, n in enumerate(lengths):
        s = int(n) - 1
        if s > cap and policy == "drop":
            first.append(None)
            continue
        first.append((k, 0, min(s, cap)))
        if s > cap and policy == "split":
            extra += [(k, o, min(s - o, cap)) for o in range(cap, s, cap)]
    rows = []
    for row in first + extra:
        if row is None:
            rows.append(None)
            continue
        k, o, s = row
        rows.append((k, o, s, -(-s // m) * m, starts[k] + o))
    return rows
