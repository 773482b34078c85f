"""The forward replaced: a scheduler step's seconds from the cost table (decodes by batch and
mean context, each prefill chunk by its tokens and the positions before it)."""

from __future__ import annotations

from daemon.loop.scheduler import SchedulerStep
from daemon.sim.table import CostTable


class StepCost:
    """A step of decodes and chunks costs its decodes' time, plus each chunk's time less one
    pass over the weights (`base`: one decode at the smallest context), which the step
    makes once whatever it holds; a chunk is never charged less than a tenth of its own time."""

    def __init__(self, table: CostTable) -> None:
        self.table = table
        self.base = table.decode.at(1, table.decode.columns[0])

    def seconds(self, step: SchedulerStep) -> float:
        decodes = [s for s in step.seqs if s.is_decode]
        chunks = [s for s in step.seqs if not s.is_decode]
        parts = []
        if decodes:
            parts.append(self.decodes(len(decodes), sum(s.start for s in decodes)))
        parts.extend(self.table.prefill.at(s.num_tokens, s.start) for s in chunks)
        if not parts:
            return 0.0
        first, rest = parts[0], parts[1:]
        return first + sum(max(p - self.base, 0.1 * p) for p in rest)

    def decodes(self, seqs: int, context: int) -> float:
        """A step of `seqs` decodes alone, `context` their positions before it in all."""
        return self.table.decode.at(seqs, context / seqs)
