"""The seeded random matchings: valid on the topology, perfect where possible, deterministic, uniform."""
import collections

import pytest

from horovod_qsgd.common.matching import random_matching


def check_matching(partner, edges=None):
    n = len(partner)
    for r, p in enumerate(partner):
        if p >= 0:
            assert p != r and 0 <= p < n and partner[p] == r, partner
            if edges is not None:
                assert (min(r, p), max(r, p)) in edges, (partner, edges)


def ring_edges(n):
    return {(min(i, (i + 1) % n), max(i, (i + 1) % n)) for i in range(n)}


@pytest.mark.parametrize("topology", ["complete", "ring"])
@pytest.mark.parametrize("n", range(1, 10))
def test_perfect_matching_on_the_topology(n, topology):
    edges = ring_edges(n) if topology == "ring" else None
    for round_index in range(60):
        partner = random_matching(n, round_index, seed=5, topology=topology)
        check_matching(partner, edges)
        assert partner.count(-1) == (1 if n == 1 else n % 2)  # perfect; one rank sits out when odd


def test_deterministic_in_seed_and_round_and_varying_with_them():
    a = [random_matching(8, r, seed=1) for r in range(50)]
    assert a == [random_matching(8, r, seed=1) for r in range(50)]
    assert a != [random_matching(8, r, seed=2) for r in range(50)]
    assert len({tuple(m) for m in a}) > 30  # 105 perfect matchings of 8 ranks


def test_complete_is_uniform_over_the_three_matchings_of_four_ranks():
    counts = collections.Counter(tuple(random_matching(4, r, seed=3)) for r in range(3000))
    assert len(counts) == 3
    # binomial(3000, 1/3): standard deviation 25.8; 5 standard deviations
    assert all(abs(c - 1000) < 130 for c in counts.values()), counts


@pytest.mark.parametrize("topology", ["complete", "ring"])
def test_the_rank_sitting_out_is_uniform(topology):
    counts = collections.Counter(random_matching(5, r, seed=4, topology=topology).index(-1) for r in range(5000))
    assert sorted(counts) == [0, 1, 2, 3, 4]
    assert all(abs(c - 1000) < 150 for c in counts.values()), counts  # sd 28.3


def test_ring_of_even_size_uses_both_perfect_matchings():
    seen = collections.Counter(tuple(random_matching(6, r, seed=0, topology="ring")) for r in range(400))
    assert set(seen) == {(1, 0, 3, 2, 5, 4), (5, 2, 1, 4, 3, 0)}
    assert all(abs(c - 200) < 60 for c in seen.values())


def test_custom_edges_give_a_maximal_matching_of_those_edges():
    edges = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (1, 5), (6, 2)]
    normal = {(min(a, b), max(a, b)) for a, b in edges}
    for round_index in range(100):
        partner = random_matching(7, round_index, seed=9, topology=edges)
        check_matching(partner, normal)
        free = {r for r, p in enumerate(partner) if p < 0}
        assert not any(a in free and b in free for a, b in normal)  # maximal
    assert random_matching(7, 0, 9, edges) == random_matching(7, 0, 9, list(reversed(edges)))


@pytest.mark.parametrize("topology, message", [
    ("torus", "topology='torus' is not supported"),
    ([(0, 0)], "must join two different ranks"),
    ([(0, 9)], "must join two different ranks"),
    ([(0,)], "is not a pair"),
])
def test_invalid_topologies_are_named(topology, message):
    with pytest.raises(ValueError, match=message):
        random_matching(4, 0, 0, topology)
