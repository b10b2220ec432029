"""Horovod Elastic with our TensorFlow compressors (horovod_qsgd/tensorflow/elastic.py): a worker lost, one added.

Each job runs ``tests/harness_samples/elastic_worker_tf.py`` under
``horovodrun --gloo --min-np 2 --max-np 3`` (tests/elastic_job.py): 3 ranks,
one killed at step 4, 2 ranks, one added after the blacklist's cooldown, 3
ranks; the training step is one ``tf.function``, traced once per process.
"""
import collections

import pytest

from tests.elastic_job import check_lost_and_added_worker, check_refused_on_every_rank, run_elastic_job

LEGACY_KERAS = {"TF_USE_LEGACY_KERAS": "1"}  # Horovod's TensorFlowKerasState calls optimizer.variables()


def test_training_goes_on_through_a_lost_and_an_added_worker(tmp_path):
    # QSGD and top-k, each with exchange="auto" and "two_stage", in one job
    by_step = check_lost_and_added_worker(*run_elastic_job(tmp_path, "elastic_worker_tf.py", **LEGACY_KERAS),
                                          vectors=("topk_auto", "topk_two_stage"))
    # the step function's trace count never changed in a process: the trace of its first step ran on worlds
    # of 3 and 2 ranks
    traces = collections.defaultdict(set)
    for rs in by_step.values():
        for r in rs:
            traces[r["pid"]].add(r["traces"])
    assert all(len(t) == 1 for t in traces.values()), traces


def test_a_worker_that_joins_with_other_settings_is_refused_on_every_rank(tmp_path):
    code, output, records, _ = run_elastic_job(tmp_path, "elastic_worker_tf.py", ELASTIC_REJOIN_RATIO="0.1",
                                               **LEGACY_KERAS)
    check_refused_on_every_rank(code, output, records)


@pytest.mark.parametrize("kind", ["QSGD", "TopK", "RandomK"])
def test_in_an_elastic_job_a_compressor_outside_the_elastic_state_refuses_with_the_fix(monkeypatch, kind):
    import tensorflow as tf
    import horovod.tensorflow as hvd

    import horovod_qsgd.tensorflow as hq
    from horovod_qsgd.tensorflow import elastic
    hvd.init()
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")  # what horovodrun sets in an elastic job's workers
    compressor = getattr(hq, kind)()
    with pytest.raises(RuntimeError, match=rf"the {kind} compressor is not part of its elastic state.*"
                                           r"horovod_qsgd\.tensorflow\.elastic\.TensorFlowKerasState\(model, "
                                           r"optimizer, compression=compression\)"):
        compressor.compress(tf.ones([20000]))
    state = elastic.TensorFlowState([tf.Variable(tf.ones([3]))], compression=compressor, epoch=0)
    assert state.compression is compressor and state.epoch == 0
    with pytest.raises(ValueError, match="needs name="):  # past the check
        compressor.compress(tf.ones([20000]))
    # Horovod's own hvd.elastic.run would end training silently when one of our collectives fails
    with pytest.raises(RuntimeError, match=r"Decorate the training function with "
                                           r"horovod_qsgd\.tensorflow\.elastic\.run instead"):
        state.sync()
