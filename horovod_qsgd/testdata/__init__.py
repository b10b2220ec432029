"""Checked-in test vectors: small inputs, codec configs and the exact payload bytes.

``vectors.npz`` is produced by ``scripts/make_vectors.py`` (run it with
``--write`` to regenerate, which is a deliberate wire-format change: bump
``WIRE_VERSION`` or explain why the bytes moved).  Each case records the
codec class and config, the float32 input, step, key, the residual before
encoding (codecs with error feedback), the expected payload and the
expected residual after encoding.

Adapters prove they reproduce the reference bytes with::

    from horovod_qsgd.testdata import check_vectors
    check_vectors(my_encode)   # raises AssertionError on any mismatch

where ``my_encode(codec, x, *, step, key, residual)`` takes the codec
object, a float32 numpy array, the step and key, and a float32 numpy
residual (a copy, or None) that it must update in place (copy results
back); it returns the payload bytes (bytes or a uint8 numpy array).
"""

import json
import os

import numpy as np

__all__ = ["VECTORS_PATH", "load_vectors", "make_codec", "check_vectors", "default_encode"]

VECTORS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vectors.npz")


def make_codec(name, config):
    from .. import codecs
    return getattr(codecs, name)(**config)


def load_vectors(path=VECTORS_PATH):
    """List of dicts: name, codec, config, step, key, x, residual, payload, residual_out."""
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["cases"]))
        cases = []
        for i, m in enumerate(meta):
            c = dict(m)
            c["x"] = z[f"x_{i}"]
            c["payload"] = z[f"payload_{i}"]
            c["residual"] = z[f"residual_{i}"] if m["has_residual"] else None
            c["residual_out"] = z[f"residual_out_{i}"] if m["has_residual"] else None
            cases.append(c)
    return cases


def default_encode(codec, x, *, step, key, residual):
    """Reference encode_fn: the codec itself on numpy arrays."""
    out = np.zeros(codec.max_payload_nbytes(x.size), np.uint8)
    n = codec.encode(x, out, step=step, key=key, residual=residual)
    return out[:n]


def check_vectors(encode_fn=default_encode, path=VECTORS_PATH):
    """Re-encode every vector with ``encode_fn`` and compare byte for byte.

    Also checks the residual after encoding (bitwise) for codecs with error
    feedback.  Returns the number of cases; raises AssertionError listing
    every mismatch.
    """
    errors = []
    cases = load_vectors(path)
    for c in cases:
        codec = make_codec(c["codec"], c["config"])
        residual = None if c["residual"] is None else c["residual"].copy()
        got = encode_fn(codec, c["x"].copy(), step=c["step"], key=c["key"], residual=residual)
        got = np.frombuffer(bytes(got), np.uint8) if not isinstance(got, np.ndarray) else got.ravel()
        want = c["payload"]
        if got.size != want.size or not np.array_equal(got, want):
            diff = np.flatnonzero(got[:min(got.size, want.size)] != want[:min(got.size, want.size)])
            errors.append(f"{c['name']}: payload {got.size} bytes vs expected {want.size}; "
                          f"first differing byte {int(diff[0]) if diff.size else min(got.size, want.size)}")
        if residual is not None and not np.array_equal(residual.view(np.uint32), c["residual_out"].view(np.uint32)):
            errors.append(f"{c['name']}: residual after encode differs from the reference")
    if errors:
        raise AssertionError(f"{len(errors)} of {len(cases)} test vectors differ:\n  " + "\n  ".join(errors))
    return len(cases)
