"""The speculative step-cost table measured at engine start: real forward + sampling (+ verify)
steps of the runner's model over synthetic batches, and the rollback. Beside the runner, not in
spec/: it drives the runner and scheduler types, which import spec/."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch
from tqdm import tqdm

from daemon.kv.manager import KVManager
from daemon.kv.tier_ops import CacheOps
from daemon.loop.request import Request, SamplingParams
from daemon.loop.runner import ModelRunner
from daemon.loop.scheduler import ScheduledSeq, SchedulerStep
from daemon.loop.spec.cost import CostRow, CostTable

log = structlog.get_logger(__name__)

PROFILE_ID = "spec-profile-{}"
CONTEXT = 128  # positions each synthetic sequence has computed before its decode / verify rows
LONG_CONTEXT = 4 * CONTEXT  # decode and verify steps timed here too: a row's cost a position


@dataclass
class _Point:
    num_seqs: int
    per_seq: int  # tokens of each sequence (0: a prefill-sized step, see `_step`)
    num_tokens: int


def profile(
    runner: ModelRunner,
    kv: KVManager,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    k: int = 5,
    repeats: int = 5,
    point_seconds: float = 0.5,
) -> CostTable:
    """Time steps over 1, 4, 16, ... `max_num_seqs` sequences of 1, 2, .. `k` + 1 tokens each
    (a few points: a decode and its drafts, verified; none past `max_num_batched_tokens`, which
    no step exceeds), and a prefill-sized step of each batch size (decodes and one chunk making
    `max_num_batched_tokens`): host preparation included, as the engine runs a step. With a
    draft network (`runner.drafting`: layer skipping, a draft model) every step also runs
    its `mirror` (a draft model's forward of the step's rows) and every verify point makes
    `k` drafts per sequence at its end, as a sequence that verifies drafts does in the engine
    (one that verifies none stops drafting): the drafting cost is in the table's verify
    points, so choosing any draft for a sequence is charged its passes, spread over its first
    drafts' tokens by the table's interpolation. The synthetic drafts are all rejected: their snapshot
    and restore (`rollback_seconds`, timed apart) are taken out of the verify points; decode
    and verify steps at a longer context give what a decode row and a draft row cost per
    position (`context_seconds`, `draft_context_seconds`). Each
    point is the median of up to `repeats` runs after an untimed one, fewer once the point has
    taken `point_seconds` (a first run that long is its own measurement); each row is then made
    non-decreasing in tokens, against the noise of a shared machine. Must run before any
    request: the synthetic sequences take blocks from `kv` and write them, and give them back
    after. Batch sizes whose sequences the KV pool cannot hold are left out (the table
    extrapolates)."""
    generator_state = runner.generator.get_state()
    previous_threads = torch.get_num_threads()
    started = time.perf_counter()
    # greedy rows: a verify then costs its forward and an argmax a row; sampled rows cost
    # more (SmolLM2 on 2 cores: ~0.25 ms a row of its 49K vocabulary), which the policy's
    # online correction takes from the steps it measures
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0)
    reqs = [Request(PROFILE_ID.format(i), [], params) for i in range(max_num_seqs)]
    try:
        drafts = k if runner.drafting is not None else 0
        points = _plan(kv, reqs, max_num_seqs, max_num_batched_tokens, k, drafts)
        if not points:
            raise ValueError(f"the KV pool holds no sequence of {CONTEXT + k + 1} positions")
        fitted = max(p.num_seqs for p in points)
        rollback = _rollback_seconds(runner, kv, reqs[: min(8, fitted)], repeats)
        rows: dict[int, tuple[list[int], list[float]]] = {}
        for point in tqdm(points, desc="profiling step costs", unit="point", leave=False):
            step = _step(reqs, point, runner.vocab_size, drafts)
            seconds = _time(runner, kv, step, repeats, point_seconds)
            tokens, measured = rows.setdefault(point.num_seqs, ([], []))
            if point.per_seq > 1:  # the rollback term is apart: every draft here is rejected
                # (and no verify step costs less than the decodes it extends, measured first)
                seconds = max(seconds - rollback * point.num_seqs, measured[0])
            tokens.append(point.num_tokens)
            measured.append(seconds)
        per_position, per_draft_position = _context_seconds(
            runner, kv, reqs, fitted, k, drafts, runner.vocab_size, repeats, point_seconds
        )
    finally:
        for req in reqs:
            kv.free(req.request_id)
        runner.generator.set_state(generator_state)
        torch.set_num_threads(previous_threads)
    table = CostTable(
        [
            CostRow(s, tokens, _non_decreasing(measured))
            for s, (tokens, measured) in sorted(rows.items())
        ],
        rollback,
        runner.device.type,
        CONTEXT,
        per_position,
        per_draft_position,
    )
    log.info(
        "spec step costs",
        seconds=round(time.perf_counter() - started, 2),
        points=len(points),
        measured={s: [round(t, 6) for t in m] for s, (_, m) in sorted(rows.items())},
        table=table.to_json(),
    )
    return table


def _context_seconds(
    runner: ModelRunner,
    kv: KVManager,
    reqs: list[Request],
    seqs: int,
    k: int,
    drafts: int,
    vocab_size: int,
    repeats: int,
    budget: float,
) -> tuple[float, float | None]:
    """What a decode row and a draft row cost per position of context: decode steps of `seqs`
    sequences at CONTEXT and at LONG_CONTEXT positions, and steps where each verifies `k`
    drafts (drafting `drafts` more, as the grid's verify points), back to back (a quarter as
    many sequences while the pool cannot hold them that long); (0, None) where not even one
    fits. The grid's blocks are given back first."""
    for req in reqs:
        kv.free(req.request_id)
    positions = LONG_CONTEXT + k + 1 + drafts
    while seqs >= 1 and not all(kv.grow(r.request_id, positions) for r in reqs[:seqs]):
        for req in reqs[:seqs]:
            kv.free(req.request_id)
        seqs //= 4
    if seqs < 1:
        return 0.0, None

    def slope(point: _Point) -> float:  # seconds a position of context more, the whole step
        at = {
            ctx: _time(runner, kv, _step(reqs, point, vocab_size, drafts, ctx), repeats, budget)
            for ctx in (CONTEXT, LONG_CONTEXT)
        }
        return (at[LONG_CONTEXT] - at[CONTEXT]) / (LONG_CONTEXT - CONTEXT)

    per_position = max(0.0, slope(_Point(seqs, 1, seqs)) / seqs)
    if k < 1:
        return per_position, None
    verify = slope(_Point(seqs, k + 1, seqs * (k + 1))) / seqs  # a decode row and k draft rows
    return per_position, max(0.0, (verify - per_position) / k)


def _time(
    runner: ModelRunner, kv: KVManager, step: SchedulerStep, repeats: int, budget: float
) -> float:
    times: list[float] = []
    spent = 0.0
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        runner.execute(runner.prepare(step, kv, CacheOps()))
        elapsed = time.perf_counter() - t0
        spent += elapsed
        if r or elapsed > budget:
            times.append(elapsed)
        if times and spent > budget:
            break
    return statistics.median(times)


def _non_decreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def _plan(
    kv: KVManager,
    reqs: list[Request],
    max_num_seqs: int,
    max_num_batched_tokens: int,
    k: int,
    drafts: int = 0,
) -> list[_Point]:
    """The grid, by batch size and then tokens, with every block it needs taken from `kv` now
    (`drafts`: positions past the verify rows that draft passes write): the decode / verify
    rows of every batch size that fits first, then the prefill chunk."""
    per_seq = sorted({1, 2, k // 2 + 1, k + 1})
    seq_counts = sorted({min(4**e, max_num_seqs) for e in range(max_num_seqs.bit_length())})
    fitted = []
    for s in seq_counts:
        if s > max_num_batched_tokens:
            break  # no step has that many decodes
        if not all(kv.grow(r.request_id, CONTEXT + k + 1 + drafts) for r in reqs[:s]):
            break
        fitted.append(s)
    # the prefill chunk is always the first sequence's: one long table serves every row
    prefill = bool(fitted) and kv.grow(reqs[0].request_id, max_num_batched_tokens)
    points: list[_Point] = []
    for s in fitted:
        # no step is larger than the scheduler's token budget (drafts count against it)
        row = [_Point(s, n, s * n) for n in per_seq if s * n <= max_num_batched_tokens]
        if prefill and max_num_batched_tokens > row[-1].num_tokens:
            row.append(_Point(s, 0, max_num_batched_tokens))
        points.extend(row)
    return points


def _step(
    reqs: list[Request],
    point: _Point,
    vocab_size: int,
    drafts: int = 0,
    context: int = CONTEXT,
) -> SchedulerStep:
    """Decodes (1 token each) or decodes with `per_seq` - 1 drafts after `context` computed
    positions, each verify also drafting `drafts` at its end; a prefill-sized point: decodes
    and one prefill chunk from position 0 making `num_tokens`. Every input token is known, as
    sampled tokens would be."""
    seqs = []
    for i, req in enumerate(reqs[: point.num_seqs]):
        prefill = point.per_seq == 0 and i == 0
        start = 0 if prefill else context
        n = point.num_tokens - (point.num_seqs - 1) if prefill else max(point.per_seq, 1)
        req.prompt_ids = [(31 * p + i) % vocab_size for p in range(start + n)]
        req.slot = i
        draft = req.prompt_ids[start + 1 :] if not prefill else []
        after = drafts if point.per_seq > 1 else 0
        seqs.append(ScheduledSeq(req, start, n, True, 0, draft=draft, draft_after=after))
    seqs.sort(key=lambda s: s.order)
    return SchedulerStep(seqs)


def _rollback_seconds(
    runner: ModelRunner, kv: KVManager, reqs: list[Request], repeats: int
) -> float:
    """Per sequence: the cache's snapshot at the verify rows' start and the restore after a
    rejection (what a verifying sequence may cost beyond its tokens)."""
    if not reqs:
        return 0.0
    cache = runner.cache
    sync: Callable[[], None] = (
        runner.device_module.synchronize if runner.device_module is not None else lambda: None
    )
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            sync()
            t0 = time.perf_counter()
            for req in reqs:
                tables = kv.block_tables(req.request_id)
                cache.restore_state(cache.snapshot(tables, CONTEXT), tables)
            sync()
            times.append((time.perf_counter() - t0) / len(reqs))
    return statistics.median(times[1:])
