"""The language-model study's parts (no training): the corpus split, the batches, the model in both frameworks."""
import numpy as np
import pytest

from benchmarks import byte_lm
from benchmarks.lm_convergence import STUDY, learning_rate
from benchmarks.stdlib_text import FILE_SEPARATOR, Corpus, is_validation, source_files

SMALL = {"width": 32, "layers": 2, "context": 16}


@pytest.fixture(scope="module")
def corpus():
    return Corpus()


def test_split_is_by_file_and_skips_test_suites(corpus):
    files = source_files()
    assert files == sorted(files) and not any(part in ("test", "tests", "site-packages")
                                               for f in files for part in f.split("/")[:-1])
    validation = [f for f in files if is_validation(f)]
    assert 0.05 < len(validation) / len(files) < 0.15
    assert corpus.files == {"train": len(files) - len(validation), "validation": len(validation)}
    assert int((corpus.validation == FILE_SEPARATOR[0]).sum()) == len(validation)
    described = corpus.describe()
    assert described["train_bytes"] == corpus.train.size and len(described["sha256"]) == 16


def test_every_rank_count_sees_the_same_global_batch(corpus):
    batch = corpus.training_batch(seed=3, step=7, batch_size=32, length=64)
    assert batch.shape == (32, 65) and batch.dtype == np.uint8
    assert np.array_equal(batch, corpus.training_batch(3, 7, 32, 64))
    assert not np.array_equal(batch, corpus.training_batch(3, 8, 32, 64))
    for ranks in (2, 4, 8):
        shards = [batch[r::ranks] for r in range(ranks)]
        assert sorted(map(bytes, np.concatenate(shards))) == sorted(map(bytes, batch))
    assert np.array_equal(corpus.validation_batch(8, 64), corpus.validation_batch(8, 64))


def test_schedule_warms_up_then_decays_to_a_tenth():
    rates = [learning_rate(t, STUDY) for t in range(STUDY["steps"])]
    assert rates[0] == STUDY["lr"] / STUDY["warmup_steps"]
    assert max(rates) == rates[STUDY["warmup_steps"]] == STUDY["lr"]
    assert np.isclose(rates[-1], STUDY["lr"] * (STUDY["final_lr_fraction"] + 0.9 * 0.5 * (1 + np.cos(
        np.pi * (STUDY["steps"] - 1 - STUDY["warmup_steps"]) / (STUDY["steps"] - STUDY["warmup_steps"])))))
    assert all(a >= b for a, b in zip(rates[STUDY["warmup_steps"]:], rates[STUDY["warmup_steps"] + 1:]))


def test_initial_weights_depend_on_the_seed_only():
    weights = byte_lm.initial_weights(1, **SMALL)
    assert list(weights) == list(byte_lm.parameter_shapes(**SMALL))
    assert all(np.array_equal(a, b) for a, b in zip(weights.values(), byte_lm.initial_weights(1, **SMALL).values()))
    assert not np.array_equal(weights["embedding"], byte_lm.initial_weights(2, **SMALL)["embedding"])
    assert np.all(weights["block0/norm1/gain"] == 1) and np.all(weights["head_bias"] == 0)
    assert weights["block0/mlp/out"].std() < weights["block0/mlp/in"].std() / 1.5  # 1/sqrt(2 layers) scaling


def test_both_frameworks_compute_the_same_model(corpus):
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("tensorflow")
    weights = byte_lm.initial_weights(0, **SMALL)
    weights = {k: v + np.float32(0.1) * np.random.default_rng(5).standard_normal(v.shape).astype(np.float32)
               for k, v in weights.items()}  # away from the init's symmetric zeros and ones
    tokens = corpus.training_batch(0, 0, 4, SMALL["context"])[:, :-1].astype(np.int64)
    logits_torch = byte_lm.forward({k: torch.from_numpy(v) for k, v in weights.items()}, torch.from_numpy(tokens),
                                   byte_lm.TorchOps(), heads=4).numpy()
    logits_tf = byte_lm.forward({k: tf.constant(v) for k, v in weights.items()}, tf.constant(tokens),
                                byte_lm.TensorFlowOps(), heads=4).numpy()
    assert logits_torch.shape == (4, SMALL["context"], byte_lm.VOCABULARY)
    np.testing.assert_allclose(logits_torch, logits_tf, rtol=0, atol=2e-5 * np.abs(logits_torch).max())
    # causal: changing the last byte changes no earlier position's logits
    changed = tokens.copy()
    changed[:, -1] = (changed[:, -1] + 1) % 256
    after = byte_lm.forward({k: torch.from_numpy(v) for k, v in weights.items()}, torch.from_numpy(changed),
                            byte_lm.TorchOps(), heads=4).numpy()
    assert np.array_equal(after[:, :-1], logits_torch[:, :-1]) and not np.array_equal(after[:, -1], logits_torch[:, -1])
