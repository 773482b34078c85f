"""Scheduler and KV manager without a model: budgets, chunking, caps, preemption, frees."""

from __future__ import annotations

import pytest
import torch

from daemon.kv.block_pool import BlockPool
from daemon.kv.manager import KVManager
from daemon.kv.spec import FullAttentionSpec, KVGroup
from daemon.loop.request import FinishReason, Request, SamplingParams
from daemon.loop.scheduler import ScheduledSeq, Scheduler, decode_context
from daemon.loop.spec.base import Draft
from daemon.loop.spec.cost import CostRow, CostTable
from daemon.loop.spec.policy import AdaptivePolicy, FixedPolicy
from daemon.loop.spec.speculator import Speculator

SPEC = FullAttentionSpec(
    block_size=4, num_layers=1, dtype=torch.float32, num_kv_heads=1, head_dim=2
)


def make(num_blocks: int, max_seqs: int = 8, budget: int = 16) -> Scheduler:
    kv = KVManager([KVGroup(SPEC, (0,))], num_blocks * SPEC.bytes_per_block)
    assert kv.num_blocks == [num_blocks]
    return Scheduler(kv, max_seqs, budget)


def req(name: str, prompt_len: int, max_tokens: int = 4, priority: int = 0) -> Request:
    return Request(name, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), priority)


def finish_step(s: Scheduler, step) -> None:
    """Pretend the device ran the step and the host saw its tokens."""
    for seq in step.seqs:
        seq.request.num_inflight_steps -= 1
        if seq.samples:
            seq.request.output_ids.append(7)


def test_budget_chunks_prefill_and_mixes_decodes() -> None:
    s = make(num_blocks=32, budget=10)
    a, b = req("a", 6), req("b", 12)
    s.add(a)
    s.add(b)
    step = s.schedule()
    assert [(x.request.request_id, x.start, x.num_tokens, x.samples) for x in step.seqs] == [
        ("a", 0, 6, True),
        ("b", 0, 4, False),
    ]
    finish_step(s, step)
    step = s.schedule()  # a decodes first, b continues its prefill in the rest of the budget
    assert [(x.request.request_id, x.start, x.num_tokens, x.samples) for x in step.seqs] == [
        ("a", 6, 1, True),
        ("b", 4, 8, True),
    ]
    assert step.seqs[0].is_decode and not step.seqs[1].is_decode


def test_max_num_seqs_caps_running() -> None:
    s = make(num_blocks=32, max_seqs=2)
    for name in "abc":
        s.add(req(name, 2))
    step = s.schedule()
    assert {x.request.request_id for x in step.seqs} == {"a", "b"}
    assert [r.request_id for r in s.waiting] == ["c"]


def test_no_step_past_max_tokens() -> None:
    s = make(num_blocks=8)
    a = req("a", 3, max_tokens=2)
    s.add(a)
    for _ in range(2):
        step = s.schedule()
        finish_step(s, step)
    assert s.schedule() is None  # the second token is asked for; nothing left to compute
    s.finish(a, FinishReason.LENGTH)
    assert s.kv.usage()[0].num_free == 8 and not s.has_work


def test_preemption_frees_the_lowest_priority_and_recomputes() -> None:
    s = make(num_blocks=4, budget=32)
    high, low = req("high", 8, max_tokens=8, priority=0), req("low", 7, max_tokens=8, priority=1)
    s.add(high)
    s.add(low)
    finish_step(s, s.schedule())  # 2 blocks each: the pool is full
    step = s.schedule()  # high needs a 3rd block at position 8: low is preempted
    assert [x.request.request_id for x in step.seqs] == ["high"]
    assert low.num_computed == 0 and low in s.waiting and s.num_preemptions == 1
    finish_step(s, step)
    s.finish(high, FinishReason.STOP)
    step = s.schedule()  # low recomputes prompt + its one known output, then samples
    (seq,) = step.seqs
    assert (seq.request, seq.start, seq.num_tokens, seq.samples, seq.sample_index) == (
        low,
        0,
        8,
        True,
        1,
    )


def test_preempted_request_waits_for_its_inflight_step() -> None:
    s = make(num_blocks=4, budget=32)
    high, low = req("high", 8, max_tokens=8), req("low", 7, max_tokens=8, priority=1)
    s.add(high)
    s.add(low)
    first = s.schedule()
    s.schedule()  # overlap: scheduled before the first step's outputs arrived; low is preempted
    assert low in s.waiting and low.num_inflight_steps == 1
    s.finish(high, FinishReason.ABORT)
    assert s.schedule() is None  # low's sampled token is still on the device
    finish_step(s, first)
    assert s.schedule().seqs[0].request is low


def test_block_pool_refcounts() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.incref(a)
    pool.decref(a)
    assert pool.num_free == 1
    pool.decref(a)
    pool.decref(b)
    assert pool.num_free == 3
    with pytest.raises(ValueError):
        pool.decref(a)


def test_a_request_gets_its_blocks_in_memory_order_though_they_were_freed_tail_first() -> None:
    """Freed tail first (the prefix cache evicts a request's tail before its head), the blocks
    come back in the order they were taken, least recently freed first; one allocation hands
    them out ascending, so a sequence's KV lies forward in memory, as the CPU's prefetchers
    read it (SmolLM2, 32 decodes at 300 positions: paged attention 367 us a layer over
    descending blocks, 284 over ascending ones)."""
    pool = BlockPool(8)
    first = pool.allocate(6)
    for block in reversed(first):
        pool.decref(block)
    again = pool.allocate(8)
    assert again == sorted(again) and set(again) == set(range(8))


class _Lookup:
    """Drafts two tokens for the requests named, none for the others."""

    name = "lookup"

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def propose(self, req: Request, k: int) -> Draft:
        if req.request_id not in self.names:
            return Draft([], [])
        return Draft([1, 2][:k], [0.9, 0.9][:k])

    def observe(self, req: Request, draft: Draft, accepted: int) -> None:
        pass

    def finished(self, req: Request) -> None:
        pass


def _expensive_drafts() -> AdaptivePolicy:
    """An adaptive policy to which any draft row costs ten decode steps."""
    rows = [CostRow(1, [1, 2], [1.0, 11.0]), CostRow(4, [4, 5], [1.0, 11.0])]
    return AdaptivePolicy(2, CostTable(rows), hold=True)


@pytest.mark.parametrize(
    "policy,joins", [(lambda: FixedPolicy(2), "bcd"), (_expensive_drafts, "abcd")]
)
def test_a_decode_is_held_for_drafts_only_where_they_would_be_verified(policy, joins) -> None:
    """With overlap, a decode whose token is in flight is held back a step for drafts only
    where the policy would verify a draft made from its known tokens: "a" has one, the others
    none, so they join the overlapped step (a hold would cost each a step and verify nothing);
    a policy that verifies no draft at that price holds no one."""
    s = make(num_blocks=64, budget=32)
    s.speculator = Speculator(_Lookup({"a"}), policy(), 2)
    for name in "abcd":
        s.add(req(name, 3, max_tokens=16))
    s.schedule()  # the prefills, in flight: no first token known yet
    step = s.schedule(overlapped=True)
    assert "".join(sorted(x.request.request_id for x in step.seqs)) == joins
    held = {r.request_id: r.hold_check for r in s.running}
    assert held == {n: (3, n not in joins) for n in "abcd"}


@pytest.mark.parametrize("drafting,thin", [("abc", True), ("ab", False)])
def test_a_thin_step_waits_for_the_one_in_flight(drafting: str, thin: bool) -> None:
    """With speculation and a step in flight, the next step goes only if at least half of the
    running requests can join it (the rest verify); else it waits and everyone runs after."""
    s = make(num_blocks=64, budget=32)
    s.speculator = Speculator(_Lookup(set(drafting)), FixedPolicy(2), 2)
    for name in "abcd":
        s.add(req(name, 3, max_tokens=16))
    finish_step(s, s.schedule())  # the prefills
    verify = s.schedule()
    assert sorted(x.request.request_id for x in verify.seqs if x.draft) == sorted(drafting)
    overlapped = s.schedule(overlapped=True)  # the verify step still in flight
    if not thin:
        assert sorted(x.request.request_id for x in overlapped.seqs) == ["c", "d"]
        return
    assert overlapped is None
    s.add(req("e", 3))  # a request to admit: a step is worth running
    step = s.schedule(overlapped=True)
    assert sorted(x.request.request_id for x in step.seqs) == ["d", "e"]


class _Counting(_Lookup):
    """`_Lookup` that counts its proposals by request."""

    def __init__(self, names: set[str]) -> None:
        super().__init__(names)
        self.asked: dict[str, list[int]] = {}

    def propose(self, req: Request, k: int) -> Draft:
        self.asked.setdefault(req.request_id, []).append(len(req.output_ids))
        return super().propose(req, k)


def test_a_request_whose_draft_is_declined_proposes_again_at_probes() -> None:
    """Without overlap: once the policy declines a request's draft, the drafter is asked for
    it again only 8, 16, 32 and 64 decodes after the decline, then every 64 decodes. A
    request without a draft ("b") is asked at every decode: an empty proposal is no decline."""
    s = make(num_blocks=128, budget=32)
    drafter = _Counting({"a"})
    s.speculator = Speculator(drafter, _expensive_drafts(), 2)
    for name in "ab":
        s.add(req(name, 3, max_tokens=200))
    for _ in range(180):
        finish_step(s, s.schedule())
    first = drafter.asked["a"][0]  # its first decode's draft, declined
    assert [n - first for n in drafter.asked["a"]] == [0, 8, 16, 32, 64, 128]
    assert len(drafter.asked["b"]) == 179  # every decode after its prefill
    declined = {r.request_id: r.declined_decodes for r in s.running}
    assert declined == {"a": 179, "b": 0}  # decodes since its first, declined


def test_a_declined_request_proposes_again_in_a_lighter_step() -> None:
    """A decline holds only at the load it was made at: when the step that follows is lighter
    ("b" finished: one decode, not two), "a" is asked again at once, not at its next probe;
    declined there too, it waits for the probes again."""
    s = make(num_blocks=128, budget=32)
    drafter = _Counting({"a"})
    s.speculator = Speculator(drafter, _expensive_drafts(), 2)
    a, b = req("a", 3, max_tokens=200), req("b", 3, max_tokens=200)
    s.add(a)
    s.add(b)
    for _ in range(12):
        finish_step(s, s.schedule())
    first = drafter.asked["a"][0]
    assert [n - first for n in drafter.asked["a"]] == [0, 8]
    s.finish(b, FinishReason.LENGTH)
    for _ in range(30):
        finish_step(s, s.schedule())
    assert [n - first for n in drafter.asked["a"]] == [0, 8, 11, 16, 32]
    assert a.declined_load == 1


def test_decode_context_is_the_mean_start_of_decode_and_verify_rows() -> None:
    a, b, c = req("a", 10), req("b", 10), req("c", 10)
    decode = ScheduledSeq(a, 100, 1, True, 0)
    verify = ScheduledSeq(b, 300, 3, True, 0, draft=[5, 6])
    chunk = ScheduledSeq(c, 0, 64, True, 0)
    assert decode_context([decode, verify, chunk]) == 200.0
    assert decode_context([chunk]) is None
