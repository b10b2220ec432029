"""The node-aware exchange of one tensor: compress only what crosses between nodes.

On M nodes of L ranks each (N = M·L; see ``docs/node-aware-design.md``), for a
tensor of n elements padded to L shards of ``shard`` elements (a multiple of
QSGD's bucket):

1. **In-node reduce-scatter, full precision.** Every rank sends shard j to
   local rank j, behind a digest of the tensor's name and size; local rank j
   checks the digests and adds the L shards it receives in local-rank order:
   the node's sum of shard j, the same bits on every node.
2. **Between nodes**, the engine's exchange of that node sum among the M
   ranks of local index j (one per node), as for a tensor named
   ``<name>.shard<j>`` among M ranks: the allgather at M = 2, the two stages
   from M = 3 (:class:`~horovod_qsgd.common.engine.PayloadEngine`).
3. **In-node allgather of the compressed sums**: local rank j forwards the
   bytes its last step between nodes received (the M nodes' payloads of shard
   j, or the M owners' sums of its chunks) to every rank of the node, behind a
   4-byte flag that says whether its steps 1-2 failed (a refusal, a mismatch).
4. **Decode**, on every rank, each local rank's bytes into its shard, in
   local-rank order: the sum over all N ranks, the same bits that local rank j
   would have decoded, on every rank. A rank of the node whose flag is set, or
   bytes that do not decode (another node's refusal notice), make every rank of
   the node raise: none takes a failed shard for a result.

Per node, the link between nodes carries about 2 (M-1)/M compressed shards
of the node's L ranks, i.e. about two compressed gradients: not 2·L of them
as the node-blind two stages do. Inside the node only step 1 moves full
precision; step 3 moves the compressed sums (QSGD-4 about 4x fewer bytes than
decoded shards with the nodes' allgather, 8x with their two stages), for each
rank decoding L shards instead of one.

Error feedback (top-k) lives where the compression happens: rank (node k,
local j) keeps what node k's sum of shard j did not send, at shard j's
positions of its tensor-long residual, which joins its gradient before step 1
(a residual from any other layout, flat or other nodes, joins the same way:
no mass is lost when the layout changes); from M = 3 also the owner residual
of its chunk of that shard, kept with its :meth:`NodeAwarePlan.owner_layout`.

Fusion: tensors share each step's collective (:class:`NodeAwareGroup`), 3
collectives per group at 2 nodes, 4 from 3, instead of per tensor, with every
payload and result bit as unfused. A group's members take the same exchange
between nodes. PyTorch groups a step's tensors, at most ``fusion_threshold``
and :data:`NODE_AWARE_GROUP_NBYTES` bytes of float32 gradient per group (the
groups from :class:`~horovod_qsgd.common.fusion.Fuser`, scoped by that
exchange; a larger tensor is a group of its own); TensorFlow a grouped call's
tensors that take the same exchange between nodes
(:mod:`horovod_qsgd.tensorflow.node_aware`).

The collectives are the adapters' (:mod:`horovod_qsgd.torch.node_aware`,
:mod:`horovod_qsgd.tensorflow.node_aware`: global alltoalls whose splits are
zero outside the step's peers, so no process set has to be declared in
``hvd.init()``); everything between them is here or in the engine's plan of
step 2.
"""
import functools
import itertools
import operator
import warnings
import zlib

from horovod_qsgd.codecs.base import read_bytes
from horovod_qsgd.common.chunks import chunk_unit, shard_numel
from horovod_qsgd.common.collectives import ALLTOALL, Collective
from horovod_qsgd.common.errors import CompressionMismatchError
from horovod_qsgd.common.exchange import refusal_notice
from horovod_qsgd.common.fusion import FusedAllgather, FusedTwoStage, group_label
from horovod_qsgd.common.naming import PAYLOAD_PREFIX
from horovod_qsgd.common.two_stage import KeepsOwnerResidual

NODE_AWARE = "node_aware"
FLAG_NBYTES = 4  # step 3's failure flag in front of the forwarded payloads: keeps them 4-byte aligned
# Fused groups of node-aware tensors hold at most this many bytes of float32 gradient (or fusion_threshold, if
# smaller), so a tensor this large starts alone, as soon as it is compressed. A group starts when its last member
# is: fused, the three large tensors of a 10M MLP began their in-node step only after the whole backward pass,
# and steps at 2x2 took 1.15-1.19x as long as with each alone (benchmarks/results/node-step-time/).
NODE_AWARE_GROUP_NBYTES = 4 * 1024 * 1024


STEPS = ("in_node", "cross", "cross_sums", "gather")  # a flight's collectives, in order ("cross_sums": from 3 nodes)


def collective_names(name):
    """The names of the collectives of a tensor's exchange alone, or of a fused group's, called ``name``."""
    return [f"{name}.node_aware.{step}" for step in STEPS]


def gather_flag(failed):
    """Step 3's flag (bytes) of a rank whose steps 1-2 ``failed`` or not."""
    return bytes([1 if failed else 0]) + bytes(FLAG_NBYTES - 1)


def pieces_nbytes(pieces):
    """Bytes of the buffer that ``pieces`` (:mod:`horovod_qsgd.common.fusion`'s: bytes, or (member, start, end)
    ranges of the members' buffers) make."""
    return sum(len(piece) if isinstance(piece, bytes) else piece[2] - piece[1] for piece in pieces)


def between_nodes(error, local_rank):
    """``error`` of step 2 (whose ranks are nodes) of local rank ``local_rank``'s shard with a note that says so,
    as the same exception type."""
    try:
        return type(error)(f"{error} (between nodes: its rank k is local rank {local_rank} of node k)")
    except Exception:  # an exception type that takes other arguments: as it is
        return error


def decode_forwarded(gathered, rows, decode, label, ranks_named="rank"):
    """Step 4 on one rank: decodes what each rank of the node forwarded in step 3, in local-rank order.

    ``gathered``: step 3's bytes (uint8, numpy or CUDA); ``rows``: [(rank, start, nbytes)] of each rank of
    the node, in local-rank order, where its flag and forwarded bytes lie; ``decode(j, forwarded)``: adds local
    rank j's forwarded bytes (its shard's payloads between nodes) into its shard, raising on bytes that do not
    decode. Returns None, or the error every rank of the node raises: a row too short for its flag, a rank
    whose flag says it failed (``label`` names the tensor, ``ranks_named`` how ``rank`` counts), or bytes that
    do not decode (another node's refusal notice, a mismatch), noted as between nodes.
    """
    failed = []
    for rank, start, nbytes in rows:
        if nbytes < FLAG_NBYTES:
            return CompressionMismatchError(
                f"horovod_qsgd: {label}: {ranks_named} {rank} of this node sent {nbytes} bytes of compressed "
                f"sums, fewer than the {FLAG_NBYTES}-byte flag: the ranks' tensors or node layouts differ.")
        if read_bytes(gathered, start, 1)[0] != 0:
            failed.append(rank)
    if failed:
        return RuntimeError(f"horovod_qsgd: {label} failed between nodes on {ranks_named}(s) {failed} of this node "
                            "(their error says why); its result is not used here either.")
    for j, (_, start, nbytes) in enumerate(rows):
        try:  # raises on another node's refusal notice, or a payload that does not match
            decode(j, gathered[start + FLAG_NBYTES:start + nbytes])
        except Exception as exc:
            return between_nodes(exc, j)
    return None


class NodeLayout:
    """M nodes of L ranks: this rank is local rank ``local_rank`` of node ``node``; ``members[k]``: node k's
    ranks in local-rank order. Horovod numbers ranks node by node (rank = node · L + local rank, the default);
    torch.distributed's adapters take any grouping (:class:`~horovod_qsgd.torch_shared.distributed.DistributedNodes`)."""

    def __init__(self, num_nodes, local_size, node, local_rank, members=None):
        self.num_nodes, self.local_size, self.node, self.local_rank = num_nodes, local_size, node, local_rank
        self.num_ranks = num_nodes * local_size
        self.members = members or [list(range(k * local_size, (k + 1) * local_size)) for k in range(num_nodes)]

    @classmethod
    def of_members(cls, members, rank):
        """The layout of nodes whose ranks are ``members`` (each node's, in local-rank order), seen from ``rank``."""
        node = next(k for k, ranks in enumerate(members) if rank in ranks)
        return cls(len(members), len(members[0]), node, members[node].index(rank), [list(m) for m in members])

    @classmethod
    def from_records(cls, records, rank):
        """(layout, None) from every rank's (local rank, local size, cross rank, cross size), or (None, why not).

        Every rank gets the same records, so every rank decides alike.
        """
        num_ranks = len(records)
        local_sizes = sorted({int(r[1]) for r in records})
        why_not = node_blind_reason(local_sizes, num_ranks // local_sizes[0])
        if why_not is not None:
            return None, why_not
        local_size = local_sizes[0]
        expected = [(r % local_size, local_size, r // local_size, num_ranks // local_size) for r in range(num_ranks)]
        if [tuple(int(v) for v in r) for r in records] != expected:
            return None, "its ranks are not numbered node by node (rank = cross_rank * local_size + local_rank)"
        return cls(num_ranks // local_size, local_size, rank // local_size, rank % local_size), None

    def as_list(self):
        """[nodes, ranks per node, node, local rank]: what an owner-side residual of this layout is saved with."""
        return [self.num_nodes, self.local_size, self.node, self.local_rank]

    def local_ranks(self):
        """The global ranks of this rank's node, in local-rank order."""
        return self.members[self.node]

    def cross_ranks(self):
        """The global ranks of this rank's local index on every node, in node order."""
        return [ranks[self.local_rank] for ranks in self.members]

    def in_node_splits(self, count):
        """Splits of a global alltoall that sends ``count`` to each rank of this node and nothing elsewhere."""
        splits = [0] * self.num_ranks
        for r in self.local_ranks():
            splits[r] = count
        return splits

    def cross_splits(self, counts):
        """Splits of a global alltoall that sends ``counts[k]`` to this local index's rank on node k."""
        splits = [0] * self.num_ranks
        for r, count in zip(self.cross_ranks(), counts):
            splits[r] = count
        return splits


def node_blind_reason(node_sizes, num_nodes):
    """Why a job whose nodes have ``node_sizes`` ranks (the distinct sizes) takes no node-aware exchange, or
    None: it needs ``num_nodes`` > 1 nodes of one size, more than one rank each."""
    if len(node_sizes) > 1:
        return f"its nodes differ in size ({sorted(node_sizes)} ranks)"
    if num_nodes < 2 or node_sizes[0] < 2:
        return f"it has {num_nodes} node(s) of {node_sizes[0]} rank(s)"
    return None


def looks_for_nodes(exchange, on_gpu, global_group):
    """Whether a compressor with this ``exchange`` finds the job's nodes, for gradients on a GPU (``on_gpu``)
    or not, exchanged in the global process set or group (``global_group``); where it finds several nodes of
    equal size it takes the node-aware exchange for them. The one place that ``"auto"`` chooses it: for GPU
    gradients only. On CPU nodes the full-precision steps in the node, over Gloo's TCP, cost more than they
    save at 1 Gbit/s (``benchmarks/results/ddp-hooks/nodes*``), and ``"auto"`` stays node-blind there."""
    return global_group and (exchange == NODE_AWARE or (exchange == "auto" and on_gpu))


def job_nodes(records, rank, asked):
    """The job's :class:`NodeLayout` from every rank's (local rank, local size, cross rank, cross size) as
    Horovod gives them (allgathered: alike on every rank), or None where it has none to use; ``asked``
    (exchange='node_aware' rather than 'auto') warns on every rank why not."""
    layout, why_not = NodeLayout.from_records(records, rank)
    if layout is None and asked:
        warn_node_blind(why_not)
    return layout


def warn_node_blind(why_not):
    """The warning, on every rank, where exchange='node_aware' finds no node layout to use (``why_not``)."""
    warnings.warn(f"horovod_qsgd: exchange='node_aware' needs several nodes of equal size, more than one rank "
                  f"each, but {why_not}: the exchange is node-blind (as 'auto') instead.")


def _count_mismatch(layout, received_splits, count, label, row):
    """None, or the CompressionMismatchError where a rank of the node sent another number of elements than
    ``count``, what this rank's ``row`` has."""
    expected = layout.in_node_splits(count)
    if list(received_splits) == expected:
        return None
    wrong = [r for r, (got, want) in enumerate(zip(received_splits, expected)) if got != want]
    return CompressionMismatchError(
        f"horovod_qsgd: {label}: rank(s) {wrong} of this node sent {[int(received_splits[r]) for r in wrong]} "
        f"elements where this rank's {row} has {count}: the ranks' tensors or node layouts differ (another model, "
        "or a tensor reshaped on some ranks).")


class NodeAwarePlan(KeepsOwnerResidual):
    """One tensor's node-aware exchange on one rank: its shards, and step 2's plan (``cross``, an engine plan
    among the nodes; ``crosses[j]``: local rank j's, whose payloads step 4 decodes)."""
    kind = NODE_AWARE

    def __init__(self, engine, name, numel, layout, uncompressed_nbytes):
        self.name, self.numel, self.layout, self.stats = name, numel, layout, engine.stats
        self.shard = shard_numel(numel, layout.local_size, chunk_unit(engine.codec))
        self.crosses = [engine.plan(f"{name}.shard{j}", self.shard, layout.num_nodes, layout.node,
                                    uncompressed_nbytes, 0, note_as=name) for j in range(layout.local_size)]
        self.cross = self.crosses[layout.local_rank]
        self.collective_names = collective_names(name)

    @property
    def fusion_scope(self):
        """What a fused group's members share (:class:`NodeAwareGroup` takes one exchange between nodes): the
        nodes' allgather or their two stages."""
        return self.cross.kind

    def padded_numel(self):
        """Elements of the tensor zero-padded to L shards (shard j goes to local rank j in step 1, behind the
        group's digest)."""
        return self.layout.local_size * self.shard

    def own_span(self):
        """(begin, end) of this rank's shard within the tensor (clipped to it)."""
        begin = self.layout.local_rank * self.shard
        return min(self.numel, begin), min(self.numel, begin + self.shard)

    def owner_layout(self):
        """What an owner-side residual of step 2's two stages belongs to (saved with it in checkpoints)."""
        return self.layout.as_list()

    def own_numel(self):
        """Elements of this rank's owner-side residual (step 2's two stages: its chunk of the shard)."""
        return self.cross.own_numel()


class NodeAwareGroup:
    """The node-aware exchange of several tensors (their :class:`NodeAwarePlan` s, one layout) in one collective
    per step, or of one tensor alone (``fused=False``), on arrays: each step's bytes, splits and checks, written
    once for every adapter, which allocates the buffers, joins the pieces and runs the collectives (step 1
    :meth:`in_node_splits`, :meth:`sum_in_node`; step 2 :meth:`encode_between_nodes` or
    :meth:`refuse_between_nodes`, from 3 nodes :meth:`sum_between_nodes`; step 3 :meth:`forward_in_node`; step 4
    :meth:`decode_node`). PyTorch drives them through :meth:`conduct`; TensorFlow calls them from its host ops,
    between graph collectives that a generator cannot span.

    The wire:

    1. to each rank of the node a row of 2 + Σ shard floats: a digest of the members' names and sizes (crc32,
       as two 16-bit halves, exact in float32), then each member's shard for that rank, in group order; a rank
       that grouped other tensors, or has a tensor of another size whose shards are as long, is refused by the
       row's length or its digest;
    2. between nodes, each member's payload (the nodes' allgather) or its slice for each owner (their two
       stages; the owners' sums likewise); fused, one part per peer: a manifest, then the members' bytes, as
       :mod:`horovod_qsgd.common.fusion` lays out the flat exchanges;
    3. to each rank of the node, the failure flag and the bytes step 2 received, manifests and all.

    Every member's payloads and result bits are what they are alone: fusion packs the collectives, not the codecs.
    Costs 8 bytes per rank of the node in step 1 and, fused, 16 bytes per part between nodes (forwarded in step
    3). The groups come from :class:`~horovod_qsgd.common.fusion.Fuser` (the same on every rank).
    """

    TAG_WIDTH = 2

    def __init__(self, plans, fused=True):
        self.plans, self.fused = list(plans), fused
        first = self.plans[0]
        self.layout, self.stats, self.kind = first.layout, first.stats, first.cross.kind
        if any(plan.cross.kind != self.kind for plan in self.plans):
            raise ValueError("horovod_qsgd: a node-aware group's members must take the same exchange between nodes")
        self.names = [plan.name for plan in self.plans]
        self.shards = [plan.shard for plan in self.plans]
        self.offsets = [sum(self.shards[:m]) for m in range(len(self.plans))]
        self.row = sum(self.shards)
        self.tag_width = self.TAG_WIDTH
        digest = zlib.crc32("\0".join(f"{plan.name}:{plan.numel}" for plan in self.plans).encode("utf-8"))
        self.tag = [float(digest >> 16), float(digest & 0xFFFF)]
        self.label = f"tensor {self.names[0]!r}" if len(self.names) == 1 else f"tensors {group_label(self.names)}"
        self.crosses = self.cross = None
        if fused:  # local rank j's fused exchange between nodes: the manifests name its shards
            fuse = FusedTwoStage if self.kind == "two_stage" else FusedAllgather
            self.crosses = [fuse([plan.crosses[j] for plan in self.plans]) for j in range(self.layout.local_size)]
            self.cross = self.crosses[self.layout.local_rank]

    @property
    def owns_chunks(self):
        """Whether each rank owns a chunk of its shard between nodes (their two stages, from 3 nodes): it sums
        that chunk and keeps its owner residual."""
        return self.kind == "two_stage"

    def conduct(self, transport, names, rows, steps, residuals, owner_residuals):
        """The group's four steps, conducted (:mod:`horovod_qsgd.common.collectives`): each a global alltoall
        whose splits are zero outside the step's peers (no process set to declare).

        ``names``: the collectives' names (:func:`collective_names`, or a fused group's); ``rows``: step 1's
        flat float32 send (the adapter's tensor): for each rank of the node, the tag and every member's shard
        for it; ``steps``, ``residuals``: each member's RNG step and, with error feedback, its shard residual as
        the codec takes it (else None); ``owner_residuals``: a function, called where the owners' sums are
        encoded (two stages between nodes), that returns each member's owner residual as the codec takes it,
        or None. Returns (each member's L decoded shards, float32, or None; None, or the error every rank of
        the node raises). It never raises what the ranks sent: the error comes at its end, once this rank has
        told its node in step 3.
        """
        received, received_splits = yield Collective(ALLTOALL, PAYLOAD_PREFIX + names[0], rows,
                                                     splits=self.in_node_splits())
        node_sums, error = self.sum_in_node(received, received_splits)
        del received, rows
        outs, owns, arrays = [], [None] * len(self.plans), transport.array
        if error is not None:  # every peer gets a refusal notice and forwards it in step 3: its node raises
            pieces, counts = self.refuse_between_nodes()
        else:
            outs = [transport.zeros(plan.cross.capacity(), "uint8") for plan in self.plans]
            if self.kind == "two_stage":
                owns = [transport.empty(plan.cross.own_numel(), "float32") for plan in self.plans]
            pieces, counts = self.encode_between_nodes([arrays(s) for s in node_sums], [arrays(o) for o in outs],
                                                       [arrays(o) for o in owns], steps, residuals)
        del node_sums
        received, _ = yield Collective(ALLTOALL, PAYLOAD_PREFIX + names[1], transport.concatenate(pieces, outs),
                                       splits=self.cross_splits(counts))
        if self.kind == "two_stage":  # the owners' sums, re-encoded, to every node
            outs = []
            if error is not None:
                pieces, counts = self.refuse_between_nodes(second_stage=True)
            else:
                outs = [transport.zeros(plan.cross.owned_capacity(), "uint8") for plan in self.plans]
                pieces, counts, error = self.sum_between_nodes(arrays(received), [arrays(o) for o in owns],
                                                               [arrays(o) for o in outs], steps, owner_residuals())
            del owns
            received, _ = yield Collective(ALLTOALL, PAYLOAD_PREFIX + names[2], transport.concatenate(pieces, outs),
                                           splits=self.cross_splits(counts))
        pieces, splits = self.forward_in_node(error is not None, len(received))
        gathered, gathered_splits = yield Collective(ALLTOALL, PAYLOAD_PREFIX + names[3],
                                                     transport.concatenate(pieces, [received]), splits=splits,
                                                     final=True)
        if error is not None:  # this rank's own error goes first: its node-mates raise on its flag
            return None, error
        sums = [transport.zeros(self.layout.local_size * plan.shard, "float32") for plan in self.plans]
        error = self.decode_node(arrays(gathered), gathered_splits, [arrays(s) for s in sums])
        return (None, error) if error is not None else (sums, None)

    def collectives(self, names):
        """[(kind, name)] of the collectives that :meth:`conduct` asks for, in order, named by ``names``."""
        steps = range(len(STEPS)) if self.owns_chunks else (0, 1, 3)
        return [(ALLTOALL, PAYLOAD_PREFIX + names[step]) for step in steps]

    def in_node_width(self):
        """Floats of step 1's row to each rank of the node (the tag, then every member's shard)."""
        return self.tag_width + self.row

    def in_node_splits(self):
        """Step 1's splits (elements per global rank); counts the bytes that stay in the node."""
        self.stats.add(bytes_sent_in_node=4 * self.in_node_width() * (self.layout.local_size - 1))
        return self.layout.in_node_splits(self.in_node_width())

    def check_in_node(self, received_splits):
        """None, or the CompressionMismatchError of step 1 where a rank of the node sent another number of
        elements than this rank's row has."""
        return _count_mismatch(self.layout, received_splits, self.in_node_width(), self.label,
                               "fused row" if self.fused else "row")

    def check_tags(self, tags):
        """None, or the CompressionMismatchError of step 1 where a rank of the node fused other tensors, or has
        this one in another size (``tags``: the first :attr:`tag_width` floats of each rank's row, in local-rank
        order): shards of a few elements more or less have the same length, not the same digest."""
        wrong = [r for r, tag in zip(self.layout.local_ranks(), tags) if list(tag) != self.tag]
        if not wrong:
            return None
        what = "fused other tensors with them (their names or sizes differ)" if self.fused else \
            "compressed another tensor under this name (of another size)"
        return CompressionMismatchError(
            f"horovod_qsgd: {self.label}: rank(s) {wrong} of this node {what}: every rank must compress the same "
            "tensors under the same names.")

    def sum_in_node(self, received, received_splits):
        """Step 1's result: (each member's node sum of this rank's shard, None), or (None, the error of a rank
        of the node that sent another row).

        ``received``: step 1's flat float32 result, a numpy array or a torch tensor (the sums are of its kind);
        ``received_splits``: its elements per global rank. The L shards are added in local-rank order: the same
        bits on every node.
        """
        error = self.check_in_node(received_splits)
        if error is not None:
            return None, error
        rows = received.reshape(self.layout.local_size, -1)
        error = self.check_tags(rows[:, :self.tag_width].tolist())  # one small read where the rows lie on a device
        if error is not None:
            return None, error
        sums = []
        for plan, offset in zip(self.plans, self.offsets):
            begin = self.tag_width + offset
            sums.append(functools.reduce(operator.add, rows[:, begin:begin + plan.shard]))
        return sums, None

    def encode_between_nodes(self, node_sums, outs, owns, steps, residuals):
        """Step 2: each member's node sum encoded for this local index's rank on every node.

        ``outs[m]``: zeroed uint8 of ``plans[m].cross.capacity()`` bytes; ``owns[m]`` (two stages between
        nodes, else None): float32 of ``plans[m].cross.own_numel()``, which receives its own chunk;
        ``residuals[m]``: its shard residual (error feedback, updated in place) or None. Returns (pieces,
        counts): the bytes to send as :mod:`horovod_qsgd.common.fusion` lays them out (bytes, or (member,
        start, end) ranges of ``outs``) and how many go to each node.
        """
        crosses = [plan.cross for plan in self.plans]
        if self.kind == "two_stage":
            member_counts = type(crosses[0]).encode_together(crosses, node_sums, outs, owns, steps, residuals)
            if not self.fused:
                return [(0, 0, sum(member_counts[0]))], member_counts[0]
            pieces, counts = self.cross.first_stage_pieces(member_counts)
            manifests = pieces_nbytes(piece for piece in pieces if isinstance(piece, bytes))
            self.stats.add(bytes_sent=manifests, bytes_sent_first_stage=manifests)
            return pieces, counts
        used = type(crosses[0]).encode_together(crosses, node_sums, outs, steps, residuals)
        part = [(0, 0, used[0])]
        if self.fused:
            part = self.cross.part_pieces(used)
            self.stats.add(bytes_sent=pieces_nbytes(part) - sum(used))
        return self._to_every_node(part)

    def refuse_between_nodes(self, second_stage=False):
        """Step 2 (or, ``second_stage``, its second stage) of a rank whose steps so far failed: (pieces, counts)
        of refusal notices that tell every peer, who forwards them to every rank of its node in step 3: all of
        them raise."""
        notice = refusal_notice()
        if second_stage or self.kind != "two_stage":
            return self._to_every_node([notice])
        node = self.layout.node  # the first stage: each owner but itself gets the notice in place of its slice
        return [notice] * (self.layout.num_nodes - 1), [0 if k == node else len(notice)
                                                        for k in range(self.layout.num_nodes)]

    def sum_between_nodes(self, received, owns, outs, steps, owner_residuals):
        """Step 2's second stage (two stages between nodes): the owner's sum of the slices it ``received``,
        re-encoded for every node.

        ``owns[m]``: member m's own chunk from :meth:`encode_between_nodes`; ``outs[m]``: zeroed uint8 of
        ``plans[m].cross.owned_capacity()`` bytes; ``owner_residuals[m]``: its owner residual or None. Returns
        (pieces, counts, error): where a slice does not match (then ``error``, noted as between nodes, is what
        this rank raises), a refusal notice that every peer raises on.
        """
        if self.fused:
            used, error = self.cross.sum_and_encode(received, owns, outs, steps, owner_residuals)
            part = [refusal_notice()] if error is not None else self.cross.second_stage_pieces(used)
            if error is None:
                nbytes = pieces_nbytes(part)
                self.stats.add(bytes_sent=nbytes, bytes_sent_second_stage=nbytes)
        else:  # counts its own bytes; writes a refusal notice into the buffer where a slice did not match
            used, error = self.plans[0].cross.sum_and_encode(received, owns[0], outs[0], steps[0], owner_residuals[0])
            part = [(0, 0, used)]
        pieces, counts = self._to_every_node(part)
        return pieces, counts, None if error is None else between_nodes(error, self.layout.local_rank)

    def forward_in_node(self, failed, received_nbytes):
        """Step 3: (pieces, splits) of this rank's failure flag and, unless it ``failed``, the
        ``received_nbytes`` bytes its step 2 received (buffer 0 of the pieces), to every rank of the node;
        counts the bytes that stay in the node."""
        forwarded = 0 if failed else received_nbytes
        row = [gather_flag(failed)] + ([(0, 0, forwarded)] if forwarded else [])
        return row * self.layout.local_size, self.gather_splits(forwarded)

    def _to_every_node(self, part):
        """(pieces, counts) of ``part`` to this local index's rank on every node."""
        return part * self.layout.num_nodes, [pieces_nbytes(part)] * self.layout.num_nodes

    def cross_splits(self, counts):
        """Step 2's splits (bytes per global rank) from ``counts`` per node."""
        return self.layout.cross_splits(counts)

    def gather_splits(self, forwarded_nbytes):
        """Step 3's splits (bytes per global rank): the flag and the ``forwarded_nbytes`` bytes step 2 received
        (none where it failed), to every rank of the node; counts the bytes that stay in the node."""
        row = FLAG_NBYTES + forwarded_nbytes
        self.stats.add(bytes_sent_in_node=row * (self.layout.local_size - 1))
        return self.layout.in_node_splits(row)

    def decode_node(self, gathered, received_splits, outs):
        """Step 4: decodes, in local-rank order, the bytes each rank of the node forwarded in step 3 (``gathered``,
        uint8, numpy or CUDA; ``received_splits`` per global rank) into its shard of ``outs[m]`` (float32, the
        member's L shards, zeros on entry). Returns None, or the error every rank of the node raises
        (:func:`decode_forwarded`)."""
        starts = list(itertools.accumulate(received_splits, initial=0))
        rows = [(rank, starts[rank], int(received_splits[rank])) for rank in self.layout.local_ranks()]

        def decode(j, forwarded):
            shards = [out[j * plan.shard:(j + 1) * plan.shard] for plan, out in zip(self.plans, outs)]
            if self.fused:
                self.crosses[j].decode(forwarded, shards)
            else:
                self.plans[0].crosses[j].decode(forwarded, shards[0])
        return decode_forwarded(gathered, rows, decode, self.label)
