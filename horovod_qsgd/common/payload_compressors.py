"""The arguments of ``QSGD`` and ``TopK``, written once for :mod:`horovod_qsgd.torch` and :mod:`horovod_qsgd.tensorflow`.

Each adapter's ``QSGD`` is ``class QSGD(QSGDArguments, PayloadCompressor)``:
these mixins turn the public arguments into the codecs and hand them to the
adapter's ``PayloadCompressor(codec, min_numel, exchange, second_codec,
fusion_threshold)``; the docstrings come from :mod:`horovod_qsgd.common.docs`.
"""
from horovod_qsgd.codecs import TopKCodec
from horovod_qsgd.common.fusion import DEFAULT_FUSION_THRESHOLD
from horovod_qsgd.common.two_stage import check_exchange, qsgd_codecs


class QSGDArguments:
    def __init__(self, bits=4, bucket_size=512, norm="max", encoding="fixed", scale_dtype="float32",
                 rounding="stochastic", min_numel=10000, seed=0, exchange="auto", second_stage_bits=None,
                 fusion_threshold=DEFAULT_FUSION_THRESHOLD):
        codec, second, exchange = qsgd_codecs(bits, bucket_size, norm, encoding, scale_dtype, rounding, seed,
                                              exchange, second_stage_bits)
        super().__init__(codec, min_numel, exchange, second, fusion_threshold)

    def settings(self):
        return dict(super().settings(), second_stage_bits=self.second_codec.bits)


class TopKArguments:
    def __init__(self, ratio=0.01, selector="exact", error_feedback=True, value_dtype="float32",
                 sample_ratio=0.01, min_numel=10000, seed=0, exchange="auto",
                 fusion_threshold=DEFAULT_FUSION_THRESHOLD):
        codec = TopKCodec(ratio=ratio, selector=selector, value_dtype=value_dtype, error_feedback=error_feedback,
                          seed=seed, sample_ratio=sample_ratio)
        super().__init__(codec, min_numel, check_exchange(exchange), codec, fusion_threshold)
