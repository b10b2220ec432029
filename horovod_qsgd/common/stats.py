"""Compression statistics a user can log, in the spirit of PowerSGD's compression_stats()."""
import threading


class CompressionStats:
    """Counters since the last reset. Thread-safe: torch hooks and TF ops call from several threads."""

    FIELDS = ("tensors_compressed", "tensors_passed_through", "bytes_uncompressed", "bytes_sent",
              "encode_seconds", "wait_seconds", "decode_seconds",
              "tensors_two_stage", "bytes_sent_first_stage", "bytes_sent_second_stage", "tensors_nonfinite",
              "collectives_started", "bytes_sent_in_node")

    def __init__(self):
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.FIELDS, 0)
        self._exchanges = {}

    def note_exchange(self, tensor_name, exchange):
        """Records which exchange a compressed tensor used ("allgather" or "two_stage")."""
        with self._lock:
            self._exchanges[tensor_name] = exchange

    def add(self, **increments):
        with self._lock:
            for key, value in increments.items():
                self._counts[key] += value

    def snapshot(self, reset=False):
        """Returns the counters and the compression ratio; ``reset`` zeroes them afterwards.

        ``bytes_uncompressed`` is what a plain allreduce of the same gradients
        would have contributed from this rank (the tensors' own dtype);
        ``bytes_sent`` is what this rank contributed: payloads, placeholders
        and passed-through tensors. Encode/decode seconds are host wall time
        (on GPUs they include the kernel launches' synchronisation).
        ``wait_seconds`` is how long ``decompress`` waited for the payloads
        to arrive after Horovod returned the placeholder (PyTorch: on a slow
        link the small placeholder allreduce finishes long before the
        payload allgather; TensorFlow's graph waits before decoding starts,
        so it stays 0 there).

        Two-stage exchange: ``tensors_two_stage`` tensors went that way;
        ``bytes_sent_first_stage`` are the slices this rank sent to their
        owners, ``bytes_sent_second_stage`` its re-encoded sums (both are in
        ``bytes_sent`` too). ``exchanges`` maps each compressed tensor's name
        to the exchange it used last.

        Node-aware exchange: ``exchanges`` says ``"node_aware"``;
        ``bytes_sent`` counts what this rank sent between nodes (its shard's
        payloads), ``bytes_sent_in_node`` what it sent to the other ranks of
        its node: the full-precision shards of the in-node reduce-scatter, then
        the compressed sums it received between nodes, forwarded.

        ``collectives_started``: the allgathers and alltoalls this rank started
        for compressed tensors (one per tensor with the allgather, two with the
        two stages; random-k's values and the placeholders go through Horovod's
        own allreduce, which Horovod fuses, and are not counted). Each pays
        Horovod's negotiation and N-1 message latencies.

        ``tensors_nonfinite``: compressed results that held inf or NaN (on
        every rank alike; a loss scaler skips such steps). The step left the
        error-feedback residuals as they were before it.
        """
        with self._lock:
            stats = dict(self._counts)
            stats["exchanges"] = dict(self._exchanges)
            if reset:
                self._counts = dict.fromkeys(self.FIELDS, 0)
        sent = stats["bytes_sent"]
        stats["compression_ratio"] = stats["bytes_uncompressed"] / sent if sent else float("nan")
        return stats


def merge_stats(parts):
    """Several compressors' counters as one (their sums; ``exchanges`` joined), e.g. DiLoCo's warm-up and outer
    compressors. Keys any part lacks count as 0."""
    merged = {}
    for part in parts:
        for key, value in part.items():
            if key == "exchanges":
                merged.setdefault(key, {}).update(value)
            elif key != "compression_ratio":
                merged[key] = merged.get(key, 0) + value
    return merged
