"""Improvement pass reducing the number of packs (work in progress)."""

from __future__ import annotations


def refine_plan(lengths, plan, **kwargs):
    raise NotImplementedError("refine_plan is not available yet")
