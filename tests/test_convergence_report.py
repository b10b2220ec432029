"""benchmarks/convergence.py's shared parts: schedule, initial weights and the summary table (no training)."""
import numpy as np

from benchmarks.convergence import GOAL_POINTS, format_table, initial_weights, learning_rate, summarize


def test_step_decay():
    assert [learning_rate(e, 0.1) for e in (0, 29)] == [0.1, 0.1]
    assert [round(learning_rate(e, 0.1, (20,)), 6) for e in (19, 20, 29)] == [0.1, 0.01, 0.01]


def test_initial_weights_are_torch_linear_init_and_depend_only_on_seed():
    layers = initial_weights(3)
    assert [w.shape for w, _ in layers] == [(64, 256), (256, 256), (256, 10)]
    for (w, b), (w2, b2) in zip(layers, initial_weights(3)):
        assert np.array_equal(w, w2) and np.array_equal(b, b2)
        bound = 1 / np.sqrt(w.shape[0])
        assert np.abs(w).max() <= bound and np.abs(b).max() <= bound and w.dtype == np.float32
    assert not np.array_equal(layers[0][0], initial_weights(4)[0][0])


def test_summary_pairs_seeds_and_checks_the_goal():
    def runs(finals):
        return [{"seed": seed, "loss": [1.0, 0.1], "accuracy": [50.0, acc]} for seed, acc in enumerate(finals)]

    results = {"none": runs([98.0, 97.0, 99.0]), "topk-1%": runs([97.5, 96.5, 98.5]),
               "qsgd-4bit": runs([98.0, 97.0, 98.5]), "randomk-1%": runs([90.0, 90.0, 90.0])}
    rows = {r["name"]: r for r in summarize(results)}
    assert rows["none"]["mean"] == 98.0 and rows["none"]["delta"] is None
    assert np.isclose(rows["none"]["se"], 1.0 / np.sqrt(3))
    assert (rows["none"]["min"], rows["none"]["max"]) == (97.0, 99.0)
    topk = rows["topk-1%"]
    assert np.isclose(topk["delta"], -0.5) and topk["delta_se"] == 0.0  # every seed 0.5 behind: paired s.e. 0
    assert topk["goal"] is (0.5 <= GOAL_POINTS)
    assert rows["qsgd-4bit"]["goal"] is True and rows["randomk-1%"]["goal"] is None  # not a goal config
    table = format_table(summarize(results))
    assert "| topk-1% | 97.50 | 0.58 | 96.50–98.50 | -0.50 ± 0.00 | **no** |" in table


def test_a_configuration_with_fewer_seeds_is_compared_on_its_own_seeds():
    def runs(finals):
        return [{"seed": seed, "loss": [1.0, 0.1], "accuracy": [50.0, acc]} for seed, acc in finals.items()]

    results = {"none": runs({0: 98.0, 1: 96.0, 2: 99.0}), "fp16": runs({1: 96.5})}
    fp16 = {r["name"]: r for r in summarize(results)}["fp16"]
    assert fp16["delta"] == 0.5  # against seed 1's 96.0, not the mean of three seeds (97.67)
    assert "| fp16 | 96.50 | – | 96.50–96.50 | +0.50 ± – |  |" in format_table(summarize(results))
