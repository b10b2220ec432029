"""Real text that ships with every Python: the standard library's own source, as bytes.

The corpus is every ``.py`` file under the interpreter's ``stdlib`` directory
(``sysconfig.get_paths()["stdlib"]``), skipping test suites (directories named
``test``, ``tests``, ``idle_test``) and installed packages (``site-packages``,
``dist-packages``). Files are taken in sorted order of their relative path, each
followed by one ``\\0`` byte so that no training sequence runs silently from one
file into the next. A file goes to validation when the CRC-32 of its relative
path is 0 modulo 10 (about a tenth of the files, fixed whatever the machine's file
order), everything else to training.

Python 3.11.7 gives 734 files, 12.1 MB; the study records the interpreter
version and a digest of both splits, since another Python gives other text.
"""
import hashlib
import os
import sys
import sysconfig
import zlib

import numpy as np

SKIPPED_DIRECTORIES = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
FILE_SEPARATOR = b"\0"
VALIDATION_MODULUS = 10


def source_files(root=None):
    """Relative paths of the corpus files under ``root`` (default: this interpreter's stdlib), sorted."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in SKIPPED_DIRECTORIES]
        found += [os.path.relpath(os.path.join(directory, f), root) for f in files if f.endswith(".py")]
    return sorted(found)


def is_validation(relative_path):
    return zlib.crc32(relative_path.replace(os.sep, "/").encode()) % VALIDATION_MODULUS == 0


class Corpus:
    """The training and validation byte streams, as uint8 numpy arrays."""

    def __init__(self, root=None):
        root = root or sysconfig.get_paths()["stdlib"]
        parts = {"train": [], "validation": []}
        for path in source_files(root):
            with open(os.path.join(root, path), "rb") as f:
                parts["validation" if is_validation(path) else "train"].append(f.read() + FILE_SEPARATOR)
        self.train = np.frombuffer(b"".join(parts["train"]), dtype=np.uint8)
        self.validation = np.frombuffer(b"".join(parts["validation"]), dtype=np.uint8)
        self.files = {name: len(chunks) for name, chunks in parts.items()}
        self.digest = hashlib.sha256(self.train.tobytes() + self.validation.tobytes()).hexdigest()[:16]

    def describe(self):
        """What a record needs to say which text was used."""
        return {"python": sys.version.split()[0], "train_files": self.files["train"],
                "validation_files": self.files["validation"], "train_bytes": int(self.train.size),
                "validation_bytes": int(self.validation.size),
                "sha256": self.digest}

    def training_batch(self, seed, step, batch_size, length):
        """``batch_size`` sequences of ``length + 1`` bytes at offsets drawn from (seed, step): the global batch.

        Every rank draws the same batch and takes its own rows, so the union of
        the ranks' rows is the same for any number of ranks dividing
        ``batch_size``.
        """
        offsets = np.random.default_rng([seed, step]).integers(0, self.train.size - length - 1, batch_size)
        return np.stack([self.train[o:o + length + 1] for o in offsets])

    def validation_batch(self, count, length):
        """``count`` sequences of ``length + 1`` bytes evenly spaced over the validation text (fixed)."""
        offsets = np.linspace(0, self.validation.size - length - 1, count).astype(np.int64)
        return np.stack([self.validation[o:o + length + 1] for o in offsets])
