"""MoE expert placement: slot layout, replica split, balanced placement vs static and EPLB."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from daemon.moe import packing
from daemon.moe.eplb_reference import eplb_global, eplb_hierarchical, eplb_placement
from daemon.moe.placement import (
    EMPTY,
    ExpertPlacement,
    Placement,
    balanced_placement,
    hot_replica_placement,
    imbalance,
    moved_slots,
    rank_loads,
    rank_share,
    robust_placement,
    static_placement,
)
from daemon.moe.stats import LoadWindow, SwapModel, drift_scenarios, recent_load

# (experts, ranks, slots per rank, EPLB groups, EPLB nodes)
SHAPES = [
    (384, 64, 7, 8, 8),
    (8, 2, 5, 2, 2),
    (16, 4, 5, 4, 2),
    (64, 8, 10, 8, 4),
    (48, 16, 4, 4, 4),
]
EXPONENTS = [0.0, 0.5, 1.0, 1.5]
SEEDS = [0, 1, 2]
# ours may trail EPLB by this much (relative max/mean); worst measured on this grid: +0.28%
# (8/2/5, s=0.5) vs global, ahead of hierarchical everywhere
EPLB_TOLERANCE = 0.005


def zipf_load(n: int, s: float, seed: int) -> np.ndarray:
    """Zipf(s) popularity over a random expert order, observed through 100k routed tokens."""
    rng = np.random.default_rng(seed)
    p = (1.0 / np.arange(1, n + 1) ** s)[rng.permutation(n)]
    return rng.multinomial(100_000, p / p.sum()).astype(np.float64)


def check_layout(pl: Placement, experts: int, ranks: int, slots: int) -> None:
    pl.validate(experts)
    assert (pl.num_ranks, pl.slots_per_rank) == (ranks, slots)
    assert len(pl.phys_to_logical) == ranks * slots
    assert sorted(p for reps in pl.logical_to_phys for p in reps) == [
        p for p, e in enumerate(pl.phys_to_logical) if e != EMPTY
    ]
    assert all(c >= 1 for c in pl.replica_counts)


def no_duplicates_on_a_rank(pl: Placement) -> bool:
    return all(len(set(row[row != EMPTY])) == int((row != EMPTY).sum()) for row in pl.table())


@pytest.mark.parametrize("experts,ranks,slots,groups,nodes", SHAPES)
def test_balanced_beats_static_and_matches_eplb(
    experts: int, ranks: int, slots: int, groups: int, nodes: int
) -> None:
    for s in EXPONENTS:
        for seed in SEEDS:
            load = zipf_load(experts, s, seed)
            ours = balanced_placement(load, ranks, slots)
            check_layout(ours, experts, ranks, slots)
            # a rank gets a second replica of an expert only for extreme skew
            assert no_duplicates_on_a_rank(ours) or s >= 1.5
            # every spare slot holds a replica
            assert sum(ours.replica_counts) == ranks * slots
            static = static_placement(experts, ranks, slots)
            glob = eplb_global(load, ranks, slots)
            hier = eplb_hierarchical(load, ranks, slots, groups, nodes)
            for ref in (static, glob, hier):
                check_layout(ref, experts, ranks, slots)
            assert imbalance(ours, load) <= imbalance(static, load) + 1e-9
            assert imbalance(ours, load) <= imbalance(glob, load) * (1 + EPLB_TOLERANCE)
            assert imbalance(ours, load) <= imbalance(hier, load) * (1 + EPLB_TOLERANCE)


def test_seed_shape_is_nearly_perfect() -> None:
    for s in (0.5, 1.0):
        load = zipf_load(384, s, 0)
        assert imbalance(balanced_placement(load, 64, 7), load) < 1.005
        assert imbalance(static_placement(384, 64, 7), load) > 1.5


def test_static_layout_is_contiguous_without_replicas() -> None:
    pl = static_placement(384, 64, 7)
    for e in range(384):
        (p,) = pl.logical_to_phys[e]
        assert pl.rank_of(p) == e // 6
    assert pl.phys_to_logical.count(EMPTY) == 64
    assert static_placement(10, 4, 3).replica_counts == [1] * 10
    with pytest.raises(ValueError):
        static_placement(13, 4, 3)


def test_validate_rejects_broken_layouts() -> None:
    Placement(2, 2, [0, 1, 2, EMPTY]).validate(3)
    with pytest.raises(ValueError, match="slots"):
        Placement(2, 2, [0, 1, 2]).validate(3)
    with pytest.raises(ValueError, match="not placed"):
        Placement(2, 2, [0, 0, 2, EMPTY]).validate(3)
    with pytest.raises(ValueError, match="out of range"):
        Placement(2, 2, [0, 1, 2, 3]).validate(3)
    layers = ExpertPlacement([Placement(2, 2, [0, 1, 2, 0]), Placement(2, 2, [0, 1, 2, 5])])
    with pytest.raises(ValueError, match="layer 1"):
        layers.validate(3)


def test_rank_loads_split_each_expert_evenly() -> None:
    pl = Placement(2, 3, [0, 1, 0, 2, 0, EMPTY])  # expert 0: two replicas on rank 0, one on 1
    assert pl.replica_counts == [3, 1, 1]
    assert pl.logical_to_phys == [[0, 2, 4], [1], [3]]
    assert rank_loads(pl, [3.0, 1.0, 2.0]) == pytest.approx([3.0, 3.0])
    assert imbalance(pl, torch.tensor([6.0, 0.0, 0.0])) == pytest.approx(4 / 3)
    load = zipf_load(384, 1.0, 3)
    assert sum(rank_loads(balanced_placement(load, 64, 7), load)) == pytest.approx(load.sum())


def test_choose_replicas_sends_tokens_to_their_expert_evenly() -> None:
    load = zipf_load(64, 1.0, 0)
    pl = balanced_placement(load, 8, 10)
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor(load / load.sum())
    experts = torch.multinomial(p, 4096 * 6, replacement=True, generator=gen).view(4096, 6)
    phys_to_logical = torch.tensor(pl.phys_to_logical)
    counts = torch.tensor(pl.replica_counts)

    phys = pl.choose_replicas(experts)  # arrival order: within one token of even
    assert phys.shape == experts.shape
    assert torch.equal(phys_to_logical[phys], experts)
    per_slot = torch.bincount(phys.flatten(), minlength=pl.num_slots)
    for e, reps in enumerate(pl.logical_to_phys):
        got = per_slot[reps]
        assert int(got.sum()) == int((experts == e).sum())
        assert int(got.max() - got.min()) <= 1

    token = torch.arange(4096).unsqueeze(1).expand_as(experts)  # token_index % replicas
    phys = pl.choose_replicas(experts, token)
    assert torch.equal(phys_to_logical[phys], experts)
    assert torch.equal(phys, pl.choose_replicas(experts, token))  # deterministic
    per_slot = torch.bincount(phys.flatten(), minlength=pl.num_slots)
    for e, reps in enumerate(pl.logical_to_phys):
        n = int((experts == e).sum())
        if counts[e] > 1 and n >= 400:
            share = per_slot[reps].double() / n
            assert float((share - 1 / counts[e]).abs().max()) < 0.25 / counts[e]


def test_previous_placement_reduces_moves() -> None:
    rng = np.random.default_rng(7)
    for s in (0.5, 1.0):
        load = zipf_load(384, s, 1)
        prev = balanced_placement(load, 64, 7)
        drifted = load * np.exp(rng.normal(0.0, 0.05, 384))
        scratch = balanced_placement(drifted, 64, 7)
        kept = balanced_placement(drifted, 64, 7, prev)
        check_layout(kept, 384, 64, 7)
        assert no_duplicates_on_a_rank(kept)
        assert moved_slots(prev, kept) < 0.3 * moved_slots(prev, scratch)
        assert imbalance(kept, drifted) <= imbalance(scratch, drifted) * 1.01 + 1e-9
        assert moved_slots(prev, balanced_placement(load, 64, 7, prev)) == 0
    layers = ExpertPlacement([prev, kept])
    assert layers.moved_slots(ExpertPlacement([prev, prev])) == moved_slots(prev, kept)


def test_hot_replicas_keep_the_residents() -> None:
    load = zipf_load(384, 1.0, 2)
    static = static_placement(384, 64, 7)
    pl = hot_replica_placement(load, static)
    check_layout(pl, 384, 64, 7)
    resident = np.asarray(static.phys_to_logical) != EMPTY
    assert np.array_equal(np.asarray(pl.phys_to_logical)[resident], np.arange(384))
    assert imbalance(pl, load) < imbalance(static, load)
    assert moved_slots(static, pl) == 64


def test_eplb_hierarchical_keeps_groups_on_one_node() -> None:
    load = zipf_load(384, 1.0, 4)
    pl = eplb_hierarchical(load, 64, 7, num_groups=8, num_nodes=8)
    node_of = [sorted({pl.rank_of(p) // 8 for p in reps}) for reps in pl.logical_to_phys]
    assert all(len(nodes) == 1 for nodes in node_of)
    for g in range(8):
        assert len({node_of[e][0] for e in range(48 * g, 48 * (g + 1))}) == 1
    # groups not divisible among nodes: the global policy
    assert eplb_placement(load, 64, 7, num_groups=3, num_nodes=2) == eplb_global(load, 64, 7)
    with pytest.raises(ValueError):
        eplb_hierarchical(load, 64, 7, num_groups=5, num_nodes=5)


# ---- robust to drift --------------------------------------------------------------------------


def swap_drift(
    n: int, s: float, rate: float, intervals: int, seed: int, per_interval: float = 1e8
) -> np.ndarray:
    """[intervals, n] counts of Zipf(s) popularity whose order random-walks: each adjacent
    pair swaps at `rate` per interval (the bench's drift)."""
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, n + 1) ** s
    order = rng.permutation(n)
    out = []
    for _ in range(intervals):
        for i in rng.integers(0, n - 1, rng.poisson(rate * (n - 1))):
            order[i], order[i + 1] = order[i + 1], order[i]
        p = np.empty(n)
        p[order] = popularity
        out.append(rng.multinomial(int(per_interval), p / p.sum()))
    return np.asarray(out, dtype=np.float64)


def continuous_drift(n: int, s: float, intervals: int, seed: int) -> np.ndarray:
    """[intervals, n] counts whose log-popularity moves a little every interval (OU)."""
    rng = np.random.default_rng(seed)
    base = np.log(1.0 / np.arange(1, n + 1) ** s)[rng.permutation(n)]
    y = rng.normal(0.0, 0.3, n)
    out = []
    for _ in range(intervals):
        y = 0.99 * y + np.sqrt(1 - 0.99**2) * 0.3 * rng.normal(size=n)
        p = np.exp(base + y)
        out.append(rng.multinomial(100_000_000, p / p.sum()))
    return np.asarray(out, dtype=np.float64)


def test_swap_model_tells_rank_swaps_from_continuous_drift() -> None:
    swaps = SwapModel.from_samples(swap_drift(384, 1.0, 0.05, 60, 0))
    # swapped an odd number of times in one interval: (1 - exp(-0.1)) / 2 = 0.048
    assert swaps.scale == np.inf
    assert 0.035 < swaps.flip < 0.06
    rates = swaps.swap_rates(np.sort(zipf_load(384, 1.0, 0))[::-1])
    assert rates == pytest.approx(np.full(383, 0.05), rel=0.3)
    # continuous drift: near-equal neighbours trade places, the hottest experts keep theirs
    cont = SwapModel.from_samples(continuous_drift(384, 1.0, 60, 0))
    assert cont.scale < 0.2
    curve = 1.0 / np.arange(1, 385)
    rates = cont.swap_rates(curve)
    assert rates[0] < 1e-3 < rates[-1]
    # no drift, one interval, nothing routed: no swaps
    still = np.tile(zipf_load(384, 1.0, 0) * 1000, (5, 1))
    assert SwapModel.from_samples(still) == SwapModel()
    assert SwapModel.from_samples(still[:1]) == SwapModel()
    assert SwapModel.from_samples(np.zeros((3, 8))) == SwapModel()


def test_drift_scenarios_move_experts_along_the_load_curve() -> None:
    load = zipf_load(384, 1.0, 0)
    assert np.array_equal(drift_scenarios(load, SwapModel(), 10, 4), np.tile(load, (4, 1)))
    futures = drift_scenarios(load, SwapModel(0.05), 10, 32)
    assert futures.shape == (32, 384)
    assert np.array_equal(np.sort(futures, 1), np.tile(np.sort(load), (32, 1)))  # permutations
    assert np.array_equal(futures, drift_scenarios(load, SwapModel(0.05), 10, 32))  # seeded
    changed = (futures != load).sum(1)
    assert changed[-8:].mean() > changed[:8].mean() > 0  # further ahead, more drift
    # common random numbers: a slightly higher rate keeps most of the same swaps
    other = drift_scenarios(load, SwapModel(0.055), 10, 32)
    assert ((other != futures).sum(1) < changed).mean() > 0.5
    # gap-dependent: experts far apart in load never trade places
    far = 10.0 ** -np.arange(8.0)
    assert np.array_equal(drift_scenarios(far, SwapModel(0.4, 0.01), 10, 8), np.tile(far, (8, 1)))


def test_load_window_keeps_drift_statistics_beyond_the_window() -> None:
    counts = swap_drift(64, 1.0, 0.1, 12, 3, per_interval=1e7)
    two_layers = np.stack([counts, counts[:, ::-1]], 1)  # [intervals, layers, experts]
    window = LoadWindow(4)
    assert window.swap_model(0) == SwapModel()
    for c in two_layers:
        window.add(torch.from_numpy(c))
    assert window.samples(1).shape == (4, 64)
    assert np.array_equal(window.samples(0), counts[-4:])
    assert np.array_equal(window.samples(1), counts[-4:, ::-1])
    assert window.swap_model(0) == window.swap_model(1)
    assert window.swap_model(0).flip > 0
    # the statistics of all 11 transitions (fading), not only the window's 3
    assert window._swaps is not None and window._swaps[0, 0].sum() > 3 * 63
    assert np.array_equal(recent_load(counts), counts[-1])
    idle = np.vstack([counts[:2], np.zeros((1, 64))])
    assert np.array_equal(recent_load(idle), counts[1])  # the last interval with load
    assert recent_load(counts[-2:], half_life=1.0) == pytest.approx(0.5 * counts[-2] + counts[-1])


def test_scenario_search_lowers_the_expected_soft_max() -> None:
    load = zipf_load(64, 1.0, 5)
    futures = drift_scenarios(load / load.sum() * 8, SwapModel(0.1), 10, 16)
    counts = packing.replica_counts(futures.max(0), 80, max_per_expert=8)
    per = futures / counts
    start = packing.greedy_pack(per.mean(0), counts, 8, 10)
    found = packing.scenario_search(start, per, 60.0)
    assert packing.soft_max_load(found, per, 60.0) < packing.soft_max_load(start, per, 60.0)
    assert np.array_equal(np.sort(found, None), np.sort(start, None))  # same replicas
    assert no_duplicates_on_a_rank(Placement(8, 10, found.reshape(-1).tolist()))
    # moving costs more than any gain: nothing moves
    kept = packing.scenario_search(start, per, 60.0, previous=start, move_cost=1.0)
    assert np.array_equal(kept, start)


def test_robust_without_drift_is_the_nominal_balance() -> None:
    for s in (0.5, 1.0):
        load = zipf_load(384, s, 0)
        samples = np.tile(load, (3, 1))
        pl = robust_placement(samples, 64, 7)
        check_layout(pl, 384, 64, 7)
        assert no_duplicates_on_a_rank(pl)
        assert sum(pl.replica_counts) == 64 * 7
        assert imbalance(pl, load) < 1.005
        assert moved_slots(pl, robust_placement(samples, 64, 7, pl)) == 0
    for experts, ranks, slots, _, _ in SHAPES:
        load = zipf_load(experts, 1.0, 1)
        pl = robust_placement(load[None], ranks, slots, drift=SwapModel(0.1))
        check_layout(pl, experts, ranks, slots)
        again = robust_placement(load[None] * 1.1, ranks, slots, pl, drift=SwapModel(0.1))
        check_layout(again, experts, ranks, slots)
    with pytest.raises(ValueError, match="intervals"):
        robust_placement(zipf_load(384, 1.0, 0), 64, 7)
    with pytest.raises(ValueError, match="non-negative"):
        robust_placement(-np.ones((2, 384)), 64, 7)
    with pytest.raises(ValueError, match="shape"):
        robust_placement(np.ones((1, 384)), 64, 7, static_placement(384, 96, 5))


def test_robust_placement_hedges_against_drift() -> None:
    """On futures it has not seen (other draws of the same drift), the robust placement's
    expected busiest rank is lower than the nominal balance's, and it stays close on the
    current load."""
    for s in (0.8, 1.0):
        samples = swap_drift(384, s, 0.025, 10, 7, per_interval=1.3e8)
        load = samples[-1]
        model = SwapModel(0.025)
        robust = robust_placement(samples, 64, 7, drift=model)
        nominal = balanced_placement(load, 64, 7)
        futures = drift_scenarios(load, model, 10, 256, seed=99)

        def busiest(pl: Placement, futures: np.ndarray = futures) -> float:
            loads = futures @ rank_share(pl, 384)
            return float((loads.max(1) / loads.mean(1)).mean())

        assert busiest(robust) < busiest(nominal) - 0.015
        assert imbalance(robust, load) < 1.1


def test_robust_placement_keeps_moves_low() -> None:
    samples = swap_drift(384, 1.0, 0.025, 20, 11, per_interval=1.3e8)
    model = SwapModel.from_samples(samples)
    prev = robust_placement(samples[:10], 64, 7, drift=model)
    t = time.perf_counter()
    kept = robust_placement(samples[10:], 64, 7, prev, drift=model)
    assert time.perf_counter() - t < 2.0  # ~40 ms on one core
    check_layout(kept, 384, 64, 7)
    scratch = robust_placement(samples[10:], 64, 7, drift=model)
    assert moved_slots(prev, kept) < 0.3 * moved_slots(prev, scratch)
