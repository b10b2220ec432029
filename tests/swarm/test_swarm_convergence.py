"""SwarmSGD with local steps and 8-bit lattice model exchange trains the digits MLP as well as synchronous SGD."""
import pytest

SHARED_LAUNCHES = "horovod.torch"  # a launch per rank count and env with the torch modules (tests/multirank.py)


@pytest.mark.ranks(2, timeout=300)
def test_swarm_lattice8_within_one_point_of_synchronous_sgd(hvd_torch):
    from benchmarks.convergence import train_digits_torch
    from benchmarks.swarm_convergence import train_digits_swarm
    from horovod_qsgd.torch import NoCompression
    _, sync = train_digits_torch(hvd_torch, NoCompression)  # the task of benchmarks/convergence.py
    swarm = train_digits_swarm(hvd_torch, {"local_steps": 4, "quantization": "lattice8"})
    stats = swarm["stats"]
    print(f"digits test accuracy: synchronous SGD {sync[-1]:.2f}%, SwarmSGD H=4 lattice8 "
          f"{swarm['final_accuracy']:.2f}% (own models {swarm['accuracy'][-1]:.2f}%), {stats}")
    assert sync[-1] > 93.0, sync
    assert abs(swarm["final_accuracy"] - sync[-1]) <= 1.0, (swarm, sync)
    # it really exchanged 8-bit models, every 4 steps: about 1 byte per coordinate per round
    assert stats["rounds"] == swarm["steps"] // 4 and stats["rounds_sat_out"] == 0
    assert stats["tensors_compressed"] >= 3 * (stats["rounds"] - 1)  # all but the calibration round
    bytes_per_coord_round = stats["bytes_sent"] / swarm["parameters"] / stats["rounds"]
    assert bytes_per_coord_round < 1.3, bytes_per_coord_round
    assert stats["fallback_rounds"] <= stats["rounds"] // 5, stats
