"""Horovod Elastic with our compressors (horovod_qsgd/torch/elastic.py): a worker lost, a worker added.

Each job runs ``tests/harness_samples/elastic_worker.py`` under ``horovodrun
--gloo --min-np 2 --max-np 3`` (tests/elastic_job.py): 3 ranks, one killed
at step 4, 2 ranks, one added after the blacklist's cooldown, 3 ranks.
"""
import pytest

from tests.elastic_job import check_lost_and_added_worker, check_refused_on_every_rank, run_elastic_job


def test_training_goes_on_through_a_lost_and_an_added_worker(tmp_path):
    # QSGD and top-k, each with exchange="auto" and "two_stage", in one job
    check_lost_and_added_worker(*run_elastic_job(tmp_path, "elastic_worker.py"),
                                vectors=("topk_auto", "topk_two_stage"))


def test_a_worker_that_joins_with_other_settings_is_refused_on_every_rank(tmp_path):
    code, output, records, _ = run_elastic_job(tmp_path, "elastic_worker.py", ELASTIC_REJOIN_RATIO="0.1")
    check_refused_on_every_rank(code, output, records)


@pytest.mark.parametrize("kind", ["QSGD", "TopK", "RandomK"])
def test_in_an_elastic_job_a_compressor_outside_the_elastic_state_refuses_with_the_fix(monkeypatch, kind):
    import horovod.torch as hvd
    import torch

    import horovod_qsgd.torch as hq
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")  # what horovodrun sets in an elastic job's workers
    compressor = getattr(hq, kind)()
    with pytest.raises(RuntimeError, match=rf"the {kind} compressor is not part of its elastic state.*"
                                           r"hvd\.elastic\.TorchState\(model, optimizer, compression=compression\)"):
        compressor.compress(torch.zeros(10))
    hvd.elastic.TorchState(compression=compressor)
    with pytest.raises(RuntimeError, match="outside hvd.DistributedOptimizer"):  # past the check
        compressor.compress(torch.zeros(10))
