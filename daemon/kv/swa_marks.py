"""Where a request's sliding window is snapshotted: block boundaries, chosen at admission and
taken as the request computes past them."""

from __future__ import annotations


def snapshot_marks(known: int, computed: int, resume: int, missed_at: int, block: int) -> list[int]:
    """Boundaries to snapshot at, from `resume` (where a replay ends) on: the known tokens'
    last full block and the one before it (a repeat resumes there, as it keeps a token to
    compute) and the boundary whose lookup missed (0: none)."""
    marks = {known // block * block, (known - 1) // block * block, missed_at}
    return sorted(m for m in marks if m > computed and m >= resume)


def chunk_limit(marks: list[int], computed: int, n: int, block: int) -> int:
    """At most `n` tokens for the next chunk, ending where the ring still holds the window
    before the next mark: one block past it (the ring keeps W-1+B positions, so a boundary up
    to one block behind is still there)."""
    after = [m for m in marks if m > computed]
    return min(n, after[0] + block - computed) if after else n


def due_marks(marks: list[int], end: int, known: int, leaving: bool, block: int) -> set[int]:
    """The marks reached at `end` (taken out of `marks`), and where a request leaves its last
    boundary (the next turn resumes there)."""
    due = {m for m in marks if m <= end}
    marks[:] = [m for m in marks if m > end]
    if leaving:
        due.add(min(end, known) // block * block)
    return due
