"""Encode from 4 Python threads at once; results must equal single-threaded ones.

Run directly (test_kernel_threads.py starts it in subprocesses, once with
numba's default threading layer and once forced to ``workqueue``, the layer
that aborts the process on concurrent parallel launches unless
horovod_qsgd serialises them).  Prints the layer and exits 0 on success.
"""

import os
import sys
import threading

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from horovod_qsgd.codecs import QSGDCodec, RandomKCodec, TopKCodec  # noqa: E402
from horovod_qsgd.kernels import threading_layer  # noqa: E402

N = 200_000  # above the serial cut-off: the parallel launchers run
CODECS = [QSGDCodec(bits=4), QSGDCodec(bits=3, norm="l2", encoding="elias"), TopKCodec(ratio=0.01),
          TopKCodec(ratio=0.01, selector="gaussian"), TopKCodec(ratio=0.01, selector="sample"),
          RandomKCodec(ratio=0.01, error_feedback=True)]


def job(codec, seed, step):
    x = np.random.default_rng(seed).standard_normal(N).astype(np.float32)
    r = np.random.default_rng(seed + 1).standard_normal(N).astype(np.float32) * np.float32(0.1)
    out = np.zeros(codec.max_payload_nbytes(N), np.uint8)
    n = codec.encode(x, out, step=step, key=seed, residual=r)
    dec = np.zeros(N, np.float32)
    codec.decode_accumulate(out[:n], dec)
    return out[:n].tobytes(), r.tobytes(), dec.tobytes()


def main():
    work = [(c, 10 * i + t, t) for i, c in enumerate(CODECS) for t in range(2)]
    want = [job(*w) for w in work]
    got = [None] * len(work)
    errors = []

    def worker(tid):
        try:
            for rep in range(3):
                for j in range(tid, len(work), 4):
                    res = job(*work[j])
                    if got[j] is None:
                        got[j] = res
                    elif got[j] != res:
                        errors.append(f"job {j} differs between repetitions")
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = [j for j in range(len(work)) if got[j] != want[j]]
    print("threading layer:", threading_layer())
    if errors or bad:
        print("FAILED", errors, "jobs differing from single-threaded:", bad)
        return 1
    print(f"OK: {len(work)} jobs x 3 repetitions from 4 threads equal the single-threaded results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
