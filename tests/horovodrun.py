"""``horovodrun`` for the test harness: the same launcher, without a build check that costs every launch a
TensorFlow import.

Before it starts a Gloo job, horovodrun asks whether Horovod was built with Gloo by importing
``horovod.tensorflow`` in a forked process: 7-8 s of one core per launch on the 2-core CI machine, and the
suite launches about 70 jobs. The answer cannot change during a test session, so ``command()`` asks Horovod's
own check once per session (a clear failure if Gloo is missing) and every launch through this module skips it.
"""
import functools
import sys

import pytest


@functools.lru_cache(maxsize=None)
def _gloo_built():
    from horovod.common.util import gloo_built
    return bool(gloo_built())


def command():
    """The argv prefix that runs horovodrun (``python -m horovod.runner.launch``'s options follow it), from the
    repository root (a module of the ``tests`` package: run as a file, its folder's ``torch/`` and
    ``tensorflow/`` would shadow the frameworks)."""
    if not _gloo_built():
        pytest.fail("this Horovod was built without Gloo, which every multi-rank test uses: rebuild it with "
                    "scripts/build_horovod.py (HOROVOD_WITH_GLOO=1)", pytrace=False)
    return [sys.executable, "-m", "tests.horovodrun"]


if __name__ == "__main__":  # horovodrun's spawned helpers import this file again as __mp_main__
    import horovod.runner.launch as launch
    launch.gloo_built = lambda verbose=False: True  # asked once by command()
    launch.run_commandline()
