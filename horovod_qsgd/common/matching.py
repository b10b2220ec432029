"""Which ranks pair up in each SwarmSGD round, computed alike on every rank without communicating.

No framework code here: the matching is a pure function of (rank count,
round, seed, topology), drawn from the project's counter-based generator.
"""
import zlib

from horovod_qsgd.kernels.rng import mix64_py, stream_base

__all__ = ["random_matching", "check_edges", "TOPOLOGIES"]

TOPOLOGIES = ("complete", "ring")
_MATCHING_KEY = zlib.crc32(b"horovod_qsgd.swarm.matching")
_PURPOSE_MATCHING = 9
_GOLDEN = 0x9E3779B97F4A7C15


def _uniform_below(seed, round_index):
    """Draws of uniform integers in [0, m), from the counter-based stream (seed, round)."""
    base = int(stream_base(seed, round_index, _MATCHING_KEY, _PURPOSE_MATCHING))
    counter = [0]

    def below(m):
        counter[0] += 1
        return mix64_py(base + counter[0] * _GOLDEN) % m  # bias below m / 2**64
    return below


def check_edges(topology, num_ranks):
    """The edges of a user's topology as sorted, deduplicated (low, high) pairs; ValueError names a bad edge."""
    edges = []
    for edge in topology:
        try:
            a, b = (int(v) for v in edge)
        except (TypeError, ValueError):
            raise ValueError(f"topology: edge {edge!r} is not a pair of ranks") from None
        if a == b or not (0 <= a < num_ranks and 0 <= b < num_ranks):
            raise ValueError(f"topology: edge {edge!r} must join two different ranks in 0..{num_ranks - 1}")
        edges.append((min(a, b), max(a, b)))
    return sorted(set(edges))


def random_matching(num_ranks, round_index, seed=0, topology="complete"):
    """The pairing of ranks for one round: ``partner[r]`` is r's partner, or -1 if r sits out.

    Drawn from the counter-based generator keyed by ``(seed, round_index)``,
    so every rank computes the same matching without communicating.

    * ``"complete"``: a uniformly random perfect matching of all ranks (one
      uniformly chosen rank sits out when the count is odd).
    * ``"ring"``: ranks ``r`` and ``r+1 mod n`` are neighbours; for an even
      count one of the ring's two perfect matchings, chosen uniformly; for an
      odd count a uniformly chosen rank sits out and the path of the others
      is matched perfectly.
    * a sequence of ``(a, b)`` edges: a random maximal matching (edges in a
      random order, each taken if both ends are free); maximal, so perfect
      only where the graph allows it.
    """
    n = int(num_ranks)
    partner = [-1] * n
    below = _uniform_below(seed, round_index)
    if isinstance(topology, str):
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology={topology!r} is not supported; allowed: 'complete', 'ring' "
                             "or a sequence of (rank, rank) edges")
        if n < 2:
            return partner
        if topology == "complete" or n == 3:  # a ring of 3 is the complete graph
            order = list(range(n))
            for i in range(n - 1, 0, -1):  # Fisher-Yates
                j = below(i + 1)
                order[i], order[j] = order[j], order[i]
            pairs = [(order[k], order[k + 1]) for k in range(0, n - 1, 2)]
        elif n % 2 == 0:
            offset = below(2)
            pairs = [((offset + k) % n, (offset + k + 1) % n) for k in range(0, n, 2)]
        else:
            out = below(n)
            pairs = [((out + 1 + k) % n, (out + 2 + k) % n) for k in range(0, n - 1, 2)]
    else:
        edges = check_edges(topology, n)
        for i in range(len(edges) - 1, 0, -1):
            j = below(i + 1)
            edges[i], edges[j] = edges[j], edges[i]
        pairs, taken = [], set()
        for a, b in edges:
            if a not in taken and b not in taken:
                pairs.append((a, b))
                taken.update((a, b))
    for a, b in pairs:
        partner[a], partner[b] = b, a
    return partner
