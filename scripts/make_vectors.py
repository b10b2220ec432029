"""Generate horovod_qsgd/testdata/vectors.npz (the reference payload bytes).

    python scripts/make_vectors.py           # compare with the checked-in file
    python scripts/make_vectors.py --write   # regenerate (deliberate!)

Regenerating changes the wire format the adapters are checked against: do
it only for an intended format change, and bump WIRE_VERSION in
horovod_qsgd/codecs/header.py when old payloads become unreadable.
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from horovod_qsgd.testdata import VECTORS_PATH, default_encode, load_vectors, make_codec  # noqa: E402

CASES = [
    # name, codec, config, n, step, key, with residual
    ("qsgd_fixed_max_2bit", "QSGDCodec", dict(bits=2, bucket_size=64), 301, 0, 11, False),
    ("qsgd_fixed_max_4bit", "QSGDCodec", dict(bits=4, bucket_size=128), 301, 1, 12, False),
    ("qsgd_fixed_max_8bit", "QSGDCodec", dict(bits=8, bucket_size=100), 301, 2, 13, False),
    ("qsgd_fixed_l2_2bit", "QSGDCodec", dict(bits=2, bucket_size=64, norm="l2"), 301, 3, 14, False),
    ("qsgd_fixed_l2_4bit", "QSGDCodec", dict(bits=4, bucket_size=50, norm="l2"), 301, 4, 15, False),
    ("qsgd_fixed_l2_8bit", "QSGDCodec", dict(bits=8, bucket_size=128, norm="l2"), 301, 5, 16, False),
    ("qsgd_fixed_3bit_odd_bucket", "QSGDCodec", dict(bits=3, bucket_size=37, seed=7), 301, 6, 17, False),
    ("qsgd_fp16_scale", "QSGDCodec", dict(bits=4, bucket_size=64, scale_dtype="float16"), 301, 7, 18, False),
    ("qsgd_deterministic", "QSGDCodec", dict(bits=4, bucket_size=64, rounding="deterministic"), 301, 8, 19, False),
    ("qsgd_elias_l2", "QSGDCodec", dict(bits=4, bucket_size=64, norm="l2", encoding="elias"), 301, 9, 20, False),
    ("qsgd_elias_max_fp16", "QSGDCodec", dict(bits=6, bucket_size=100, encoding="elias",
                                                scale_dtype="float16"), 301, 10, 21, False),
    ("topk_exact_ef", "TopKCodec", dict(ratio=0.05), 301, 11, 22, True),
    ("topk_exact_fp16_noef", "TopKCodec", dict(ratio=0.1, value_dtype="float16", error_feedback=False), 301, 12, 23,
     False),
    ("topk_gaussian_ef", "TopKCodec", dict(ratio=0.05, selector="gaussian"), 301, 13, 24, True),
    ("topk_sample_ef_fp16", "TopKCodec", dict(ratio=0.05, selector="sample", value_dtype="float16", seed=3),
     301, 14, 25, True),
    ("randomk", "RandomKCodec", dict(ratio=0.05, seed=5), 301, 15, 26, False),
    ("randomk_ef_fp16", "RandomKCodec", dict(ratio=0.05, seed=5, value_dtype="float16", error_feedback=True),
     301, 16, 27, True),
    ("randomk_rescale", "RandomKCodec", dict(ratio=0.1, rescale=True), 301, 17, 28, False),
]


def inputs(i, n, with_residual):
    rng = np.random.default_rng(1000 + i)
    x = (rng.standard_normal(n) * rng.choice([0.01, 1.0, 30.0], n)).astype(np.float32)
    x[128:256] = 0.0  # zero buckets for bucket sizes 64 and 128...
    x[200] = 5.0e-3  # ...and a bucket with one nonzero
    res = (rng.standard_normal(n) * 0.05).astype(np.float32) if with_residual else None
    return x, res


def generate():
    meta, arrays = [], {}
    for i, (name, codec_name, config, n, step, key, with_res) in enumerate(CASES):
        x, res = inputs(i, n, with_res)
        codec = make_codec(codec_name, config)
        r_out = None if res is None else res.copy()
        payload = default_encode(codec, x, step=step, key=key, residual=r_out)
        meta.append(dict(name=name, codec=codec_name, config=config, step=step, key=key,
                         has_residual=res is not None, digest=codec.digest))
        arrays[f"x_{i}"] = x
        arrays[f"payload_{i}"] = np.asarray(payload, np.uint8)
        if res is not None:
            arrays[f"residual_{i}"] = res
            arrays[f"residual_out_{i}"] = r_out
    return meta, arrays


def main(argv):
    meta, arrays = generate()
    if "--write" in argv:
        np.savez_compressed(VECTORS_PATH, cases=np.array(json.dumps(meta)), **arrays)
        print(f"wrote {len(meta)} cases to {VECTORS_PATH}")
        return 0
    if not os.path.exists(VECTORS_PATH):
        print("no vectors file yet; run with --write")
        return 1
    old = load_vectors()
    bad = [m["name"] for i, m in enumerate(meta)
           if i >= len(old) or not np.array_equal(old[i]["payload"], arrays[f"payload_{i}"])]
    print(f"{len(meta) - len(bad)} of {len(meta)} cases unchanged" + (f"; changed: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
