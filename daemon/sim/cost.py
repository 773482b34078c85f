"""The forward replaced: a scheduler step's seconds from the cost table (decodes by batch and
mean context, each prefill chunk by its tokens and the positions before it), and a KV
handoff's copies on its two nodes."""

from __future__ import annotations

from daemon.loop.scheduler import SchedulerStep
from daemon.sim.table import CostTable


class StepCost:
    """A step of decodes and chunks costs its decodes' time (or its first chunk's), plus each
    other chunk's time less the part a step pays once whatever it holds (`fixed`); a chunk is
    never charged less than a tenth of its own time.

    The once-a-step part is measured where the table has steps of several chunks
    (`prefill_batch`: k chunks of n tokens cost fixed(n) + k * per_chunk(n)); a table without
    them takes one pass over the weights (`base`: one decode at the smallest context)."""

    def __init__(self, table: CostTable) -> None:
        self.table = table
        self.base = table.decode.at(1, table.decode.columns[0])
        self._fixed: dict[int, float] = {}

    def seconds(self, step: SchedulerStep) -> float:
        # a verify (a decode with drafts) costs its draft rows as decodes
        decodes = [s for s in step.seqs if s.is_decode or s.draft]
        chunks = [s for s in step.seqs if not (s.is_decode or s.draft)]
        parts = []
        if decodes:
            rows = sum(s.num_tokens for s in decodes)
            context = sum(s.start for s in decodes) / len(decodes)
            parts.append((self.table.decode.at(rows, context), 0.0))
        parts.extend(
            (self.table.prefill.at(s.num_tokens, s.start), self.fixed(s.num_tokens)) for s in chunks
        )
        if not parts:
            return 0.0
        first, rest = parts[0][0], parts[1:]
        return first + sum(max(p - fixed, 0.1 * p) for p, fixed in rest)

    def fixed(self, tokens: int) -> float:
        """What a step of chunks of `tokens` tokens pays once however many it holds."""
        got = self._fixed.get(tokens)
        if got is None:
            got = self._fixed[tokens] = self._measured_fixed(tokens)
        return got

    def _measured_fixed(self, tokens: int) -> float:
        batch = self.table.prefill_batch
        if batch is None:
            return self.base
        k = batch.columns[-1]
        one, many = batch.at(tokens, 1), batch.at(tokens, k)
        per_chunk = (many - one) / (k - 1)
        return min(max(one - per_chunk, 0.0), one)

    def decodes(self, seqs: int, context: int) -> float:
        """A step of `seqs` decodes alone, `context` their positions before it in all."""
        return self.table.decode.at(seqs, context / seqs)


def handoff(table: CostTable, tokens: int) -> tuple[int, float, float]:
    """A KV handoff of `tokens` computed positions (whole blocks of the model's layout): its
    bytes, the prefill node's export seconds (a device-to-host read, as the table's host
    copies) and the decode node's import seconds (host to device)."""
    g = table.kv
    nbytes = -(-tokens // g.block_size) * g.bytes_per_block
    return nbytes, table.host_save.seconds(nbytes), table.host_load.seconds(nbytes)
