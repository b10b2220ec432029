"""Fusion's framework-free parts: the groups every rank forms, and a fused exchange run in one process.

The multi-rank tests (tests/torch/test_fusion.py) check the same under horovodrun.
"""
import itertools

import numpy as np
import pytest

from horovod_qsgd.codecs import QSGDCodec, TopKCodec
from horovod_qsgd.common.errors import CompressionMismatchError
from horovod_qsgd.common.exchange import refusal_notice
from horovod_qsgd.common.fusion import Fuser, FusedTwoStage, pack
from horovod_qsgd.common.two_stage import TwoStage


def test_pack_is_greedy_never_spans_two_process_sets_and_keeps_big_tensors_alone():
    entries = [((0, "a"), 40), ((0, "b"), 40), ((0, "c"), 30), ((0, "d"), 200), ((0, "e"), 10), ((1, "f"), 10)]
    assert pack(entries, 100) == [[(0, "a"), (0, "b")], [(0, "c")], [(0, "d")], [(0, "e")], [(1, "f")]]
    assert pack(entries, 0) == [[key] for key, _ in entries]


def _rounds(order_of_round, threshold=100, sizes=None):
    """What a Fuser starts when tensors arrive in the given orders: [(round, where, name, keys)]."""
    sizes = sizes or {"a": 40, "b": 40, "c": 30, "d": 20}
    fuser, started = Fuser(threshold), []
    for round_index, order in enumerate(order_of_round):
        for name in order:
            for group, items in fuser.add((0, name), sizes[name], name):
                started.append((round_index, f"after {name}", group, items))
        for group, items in fuser.end_round():
            started.append((round_index, "end", group, items))
    return started


def test_every_arrival_order_forms_the_same_named_groups():
    # Collectives are matched by name: the groups and their names may not depend on the hook order.
    outcomes = set()
    for order in itertools.permutations("abcd"):
        started = _rounds([order, order, order])
        outcomes.add(tuple(sorted((r, group, tuple(sorted(items))) for r, _, group, items in started)))
        # Round 0 learns; from round 1 each group starts when its last member arrives, not at the end.
        assert all(where != "end" for r, where, _, _ in started if r > 0), started
    assert outcomes == {((0, "0.group1", ("a", "b")), (0, "0.group2", ("c", "d")),
                         (1, "0.group3", ("a", "b")), (1, "0.group4", ("c", "d")),
                         (2, "0.group3", ("a", "b")), (2, "0.group4", ("c", "d")))}


def test_a_missing_member_keeps_its_group_name_and_new_tensors_are_packed_at_the_end():
    started = _rounds(["abcd", "abd", "abcd"])
    assert [(r, where, group, sorted(items)) for r, where, group, items in started if r == 1] == [
        (1, "after b", "0.group3", ["a", "b"]), (1, "end", "0.group4", ["d"])]
    # Round 1 learned {a, b, d} (100 bytes): round 2 starts it when d arrives, and c alone at the end.
    assert [(r, where, group, sorted(items)) for r, where, group, items in started if r == 2] == [
        (2, "after d", "0.group5", ["a", "b", "d"]), (2, "end", "0.group6", ["c"])]


def test_a_tensor_compressed_twice_in_a_round_is_an_error():
    fuser = Fuser(100)
    fuser.add((0, "a"), 10, "a")
    with pytest.raises(RuntimeError, match="'a' was compressed twice.*its own name"):
        fuser.add((0, "a"), 10, "a")
    with pytest.raises(ValueError, match="fusion_threshold=-1 must be an int >= 0"):
        Fuser(-1)


def _run(codec, sizes, num_ranks, threshold, steps=2):
    """Every rank's results of fused exchanges run in one process, with the error-feedback state.

    Groups are packed by ``threshold`` (0: every tensor alone); ``threshold=None`` runs each tensor through
    :class:`TwoStage`'s own unfused calls instead. Returns (results[step][rank, tensor], residuals, owner
    residuals, bytes sent per rank).
    """
    ef = getattr(codec, "error_feedback", False)
    names = sorted(sizes)
    stages = {(r, n): TwoStage(codec, codec, n, sizes[n], num_ranks, r) for r in range(num_ranks) for n in names}
    residuals = {key: np.zeros(sizes[key[1]], np.float32) for key in stages} if ef else {}
    owner_res = {key: np.zeros(s.owned[1] - s.owned[0], np.float32) for key, s in stages.items()} if ef else {}
    groups = pack([((0, n), stages[0, n].payload_capacity()) for n in names], threshold or 0)
    results, sent = [], [0] * num_ranks
    rng = np.random.default_rng(7)
    for step in range(steps):
        grads = {key: rng.standard_normal(sizes[key[1]]).astype(np.float32) for key in stages}
        outs = {key: np.zeros(sizes[key[1]], np.float32) for key in stages}
        for group in groups:
            members = [n for _, n in group]
            fused = [FusedTwoStage([stages[r, n] for n in members]) for r in range(num_ranks)]
            inbox = [[] for _ in range(num_ranks)]
            totals = {}
            for r in range(num_ranks):
                buffers, splits = [], []
                for n in members:
                    stage = stages[r, n]
                    buf = np.zeros(stage.send_capacity(), np.uint8)
                    splits.append(stage.encode_for_owners(grads[r, n], buf, step, residuals.get((r, n))))
                    buffers.append(buf)
                    begin, end = stage.owned
                    totals[r, n] = grads[r, n][begin:end].copy()
                    if ef:
                        totals[r, n] += residuals[r, n][begin:end]
                        residuals[r, n][begin:end] = 0
                if threshold is None:
                    pieces, part_sizes = [(0, 0, sum(splits[0]))], splits[0]
                else:
                    pieces, part_sizes = fused[r].first_stage_pieces(splits)
                flat = _concatenate(pieces, buffers)
                sent[r] += flat.size
                for owner, part in zip(range(num_ranks), np.split(flat, np.cumsum(part_sizes)[:-1])):
                    inbox[owner].append(part)
            parts = []
            for r in range(num_ranks):
                owned = [np.zeros(stages[r, n].owned_capacity(), np.uint8) for n in members]
                if threshold is None:
                    (n,) = members
                    used, refusal = stages[r, n].sum_and_encode(np.concatenate(inbox[r]), totals[r, n], owned[0],
                                                                step, owner_res.get((r, n)))
                    pieces = [(0, 0, used)]
                else:
                    used, refusal = fused[r].sum_and_encode(
                        np.concatenate(inbox[r]), [totals[r, n] for n in members], owned, [step] * len(members),
                        [owner_res.get((r, n)) for n in members])
                    pieces = fused[r].second_stage_pieces(used)
                assert refusal is None
                parts.append(_concatenate(pieces, owned))
                sent[r] += parts[-1].size
            gathered = np.concatenate(parts)
            for r in range(num_ranks):
                if threshold is None:
                    stages[r, members[0]].decode_gathered(gathered, outs[r, members[0]])
                else:
                    fused[r].decode_gathered(gathered, [outs[r, n] for n in members])
        results.append(outs)
    return results, residuals, owner_res, sent


def _concatenate(pieces, buffers):
    return np.concatenate([np.frombuffer(p, np.uint8) if isinstance(p, bytes) else buffers[p[0]][p[1]:p[2]]
                           for p in pieces])


@pytest.mark.parametrize("codec, num_ranks", [(QSGDCodec(bits=4, bucket_size=128), 3),
                                              (QSGDCodec(bits=3, bucket_size=64, encoding="elias"), 4),
                                              (TopKCodec(ratio=0.05), 4)])
def test_fused_results_and_state_are_bitwise_the_unfused_ones(codec, num_ranks):
    # 100 elements: fewer buckets than ranks for some codecs, so some owners own nothing.
    sizes = {"w1": 5000, "w2": 3001, "b": 100, "w3": 2048}
    steps = 3
    plain = _run(codec, sizes, num_ranks, threshold=None, steps=steps)
    for threshold in (1 << 30, 0, 9000):
        fused = _run(codec, sizes, num_ranks, threshold=threshold, steps=steps)
        for step_fused, step_plain in zip(fused[0], plain[0]):
            for key in step_plain:
                assert np.array_equal(step_fused[key], step_plain[key]), (threshold, key)
            for name in sizes:  # every rank ends with the same bits
                assert all(np.array_equal(step_fused[r, name], step_fused[0, name]) for r in range(num_ranks))
        for state_fused, state_plain in zip(fused[1:3], plain[1:3]):
            assert state_fused.keys() == state_plain.keys()
            assert all(np.array_equal(state_fused[k], state_plain[k]) for k in state_plain)
        # The same payloads, and per group one manifest per peer in the first stage and one in the second.
        groups = len(pack([((0, n), TwoStage(codec, codec, n, sizes[n], num_ranks, 0).payload_capacity())
                           for n in sorted(sizes)], threshold))
        assert [f - p for f, p in zip(fused[3], plain[3])] == [steps * groups * 16 * num_ranks] * num_ranks


def _group_of_two(names, num_ranks=3, numel=4096):
    codec = QSGDCodec(bits=4, bucket_size=128)
    stages = [[TwoStage(codec, codec, n, numel, num_ranks, r) for n in names] for r in range(num_ranks)]
    return codec, stages


def test_a_rank_that_grouped_other_tensors_is_named_on_every_rank():
    # Rank 2 has "x" where the others have "b", of the same shape: the payloads would decode, into the wrong
    # tensor. The manifests tell: every owner raises on the first stage, every rank on the second.
    _, stages = _group_of_two(["a", "b"])
    stages[2] = _group_of_two(["a", "x"])[1][2]
    fused = [FusedTwoStage(s) for s in stages]
    rng = np.random.default_rng(0)
    inbox = [[] for _ in range(3)]
    for r in range(3):
        buffers, splits = [], []
        for stage in stages[r]:
            buf = np.zeros(stage.send_capacity(), np.uint8)
            splits.append(stage.encode_for_owners(rng.standard_normal(4096).astype(np.float32), buf, 0))
            buffers.append(buf)
        pieces, part_sizes = fused[r].first_stage_pieces(splits)
        for owner, part in enumerate(np.split(_concatenate(pieces, buffers), np.cumsum(part_sizes)[:-1])):
            inbox[owner].append(part)
    for r in range(3):
        totals = [np.zeros(s.owned[1] - s.owned[0], np.float32) for s in stages[r]]
        outs = [np.zeros(s.owned_capacity(), np.uint8) for s in stages[r]]
        used, refusal = fused[r].sum_and_encode(np.concatenate(inbox[r]), totals, outs, [0, 0], [None, None])
        assert used is None and isinstance(refusal, CompressionMismatchError)
        sender, here = (2, "a, b") if r < 2 else (0, "a, x")
        assert f"tensor '{here}': rank {sender}'s group of first-stage slices does not match" in str(refusal)
        assert "the ranks grouped other tensors" in str(refusal), refusal
    # Every owner refused: the allgather carries three notices and every rank raises, naming a refusing rank.
    gathered = np.concatenate([np.frombuffer(refusal_notice(), np.uint8)] * 3)
    with pytest.raises(CompressionMismatchError, match="rank 0 found a mismatch"):
        fused[1].decode_gathered(gathered, [np.zeros(4096, np.float32)] * 2)


def test_a_payload_of_another_shape_inside_a_group_names_the_tensor():
    codec, stages = _group_of_two(["a", "b"], num_ranks=2)
    sums = []
    for members in stages:
        owned = []
        for stage in members:
            buf = np.zeros(stage.owned_capacity(), np.uint8)
            begin, end = stage.owned
            owned.append((buf, stage.encode_owned(np.ones(end - begin, np.float32), buf, 0)))
        sums.append(_concatenate(FusedTwoStage(members).second_stage_pieces([u for _, u in owned]),
                                 [b for b, _ in owned]))
    longer = TwoStage(codec, codec, "b", 4096 + 128, 2, 0)  # rank 0's "b" has a bucket more: rank 1 owns it
    with pytest.raises(CompressionMismatchError, match=r"tensor 'b': rank 1's second-stage sum .* 2048 elements "
                                                       r"\(here 2176\)"):
        FusedTwoStage([stages[0][0], longer]).decode_gathered(
            np.concatenate(sums), [np.zeros(4096, np.float32), np.zeros(4096 + 128, np.float32)])
