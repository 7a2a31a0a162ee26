"""How a checkpoint format names our tensors: our state-dict name -> the file's tensor(s), and the check that a
file holds exactly what the model needs (one error listing every missing, unexpected and mis-shaped tensor).

A tensor we fuse may be several in the file (transformers' q / k / v for our attention ``in_proj``): they are
concatenated along dim 0 on load and split on save. A file may spell the base-model prefix differently from the
layout's canonical one (``model.`` vs ``backbone.`` across transformers versions, none for a backbone-only class).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

LM_HEAD = "lm_head.weight"
EMBEDDING = "backbone.embedding.weight"


class LayoutError(ValueError):
    """The weights of a file do not match the model its config describes."""


@dataclass(frozen=True)
class TensorLayout:
    """``pieces(ours)`` -> [(canonical file name, rows)], rows None for a single piece.

    base: the canonical base-model prefix of the file names; alternatives: other spellings of it that files use;
    ignored: regular expressions of file tensors that are not model weights; stores_tied_head: whether a tied
    lm_head.weight is written (mamba_ssm: yes, sharing storage; transformers: no).
    """

    pieces: Callable[[str], list[tuple[str, int | None]]]
    base: str = "backbone."
    alternatives: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    stores_tied_head: bool = False
    describe: str = ""

    def spellings(self, name: str) -> list[str]:
        """The canonical file name and its other spellings, in the order they are looked for."""
        out = [name]
        if self.base and name.startswith(self.base):
            out += [alt + name[len(self.base):] for alt in self.alternatives]
        return out

    def is_ignored(self, name: str) -> bool:
        return any(re.match(p, name) for p in self.ignored)


IDENTITY = TensorLayout(lambda ours: [(ours, None)], stores_tied_head=True, describe="mamba_ssm")


@dataclass
class LoadPlan:
    """our name -> [(file name, rows)] as spelled in the file (a tied head that is not stored has no entry)."""

    sources: dict[str, list[tuple[str, int | None]]]


def plan_load(layout: TensorLayout, expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]],
              tied: bool, where: str, what: str) -> LoadPlan:
    """Match the model's tensors (``expected``: our name -> shape) with the file's (``found``: name -> shape).

    Raises LayoutError naming, with the file's names, every missing, unexpected and mis-shaped tensor.
    """
    sources: dict[str, list[tuple[str, int | None]]] = {}
    missing, mismatched, used = [], [], set()
    for ours, shape in expected.items():
        pieces = layout.pieces(ours)
        resolved = []
        for canonical, rows in pieces:
            hit = next((n for n in layout.spellings(canonical) if n in found), None)
            resolved.append((hit if hit is not None else canonical, rows, hit is not None))
        if not all(ok for _, _, ok in resolved):
            if not (tied and ours == LM_HEAD):  # a tied head may or may not be stored
                missing += [n for n, _, ok in resolved if not ok]
            continue
        used.update(n for n, _, _ in resolved)
        if len(resolved) == 1:
            name = resolved[0][0]
            if tuple(found[name]) != tuple(shape):
                mismatched.append((name, tuple(shape), tuple(found[name])))
        else:
            for name, rows, _ in resolved:
                want = (rows, *shape[1:])
                if tuple(found[name]) != want:
                    mismatched.append((name, want, tuple(found[name])))
        sources[ours] = [(n, r) for n, r, _ in resolved]
    unexpected = [n for n in found if n not in used and not layout.is_ignored(n)]
    if missing or unexpected or mismatched:
        lines = [f"{where}: the weights do not match {what}"]
        if mismatched:
            lines.append(f"  shape mismatch ({len(mismatched)}):")
            lines += [f"    {n}: expected {e}, found {f}" for n, e, f in mismatched]
        if missing:
            lines.append(f"  missing ({len(missing)}): " + ", ".join(missing))
        if unexpected:
            lines.append(f"  unexpected ({len(unexpected)}): " + ", ".join(unexpected))
        raise LayoutError("\n".join(lines))
    return LoadPlan(sources)


def split_for_save(layout: TensorLayout, state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """Our state dict -> the file's tensors (split where the format stores pieces), canonical names."""
    out = {}
    for ours, t in state.items():
        if tied and ours == LM_HEAD and not layout.stores_tied_head:
            continue
        pieces = layout.pieces(ours)
        if len(pieces) == 1:
            out[pieces[0][0]] = t
            continue
        rows = [r for _, r in pieces]
        if sum(rows) != t.shape[0]:
            raise LayoutError(f"{ours}: {t.shape[0]} rows cannot be split into {rows}")
        for (name, _), part in zip(pieces, t.split(rows, dim=0)):
            out[name] = part.contiguous()
    return out
