"""The multi-node harness (benchmarks/nodelab.py): ranks on several network namespaces, bytes counted per link.

Horovod (without ssh) and torchrun must see the layout a cluster of that many
nodes gives them, and a ring allreduce's bytes must appear where a ring puts
them: each of the ``nodes`` node boundaries crossed with 2 (N-1)/N of the
buffer on the NICs, the in-node hops on the loopbacks.
"""
import json
import sys

import pytest

from benchmarks import netlab, nodelab
from tests.harness_samples.node_probe import NUMEL

LAYOUTS = [("horovodrun", 2, 2), ("horovodrun", 3, 2), ("torchrun", 2, 2)]


@pytest.fixture(autouse=True)
def _root_needed():
    reason = netlab.unavailable_reason()
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize("launcher,nodes,per_node", LAYOUTS)
def test_ranks_see_the_node_layout_and_bytes_cross_where_the_ring_crosses(tmp_path, launcher, nodes, per_node):
    code, sent = nodelab.run(nodes, per_node, [sys.executable, "-m", "tests.harness_samples.node_probe", launcher,
                                               str(tmp_path)], launcher=launcher, timeout=240)
    assert code == 0
    ranks = nodes * per_node
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]
    for r, report in enumerate(reports):
        assert report == dict(rank=r, size=ranks, local_rank=r % per_node, local_size=per_node,
                              cross_rank=r // per_node, cross_size=nodes, total=[ranks * (ranks - 1) / 2]), report
    ring = 2 * (ranks - 1) / ranks * 4 * NUMEL  # bytes on every link of the ring
    between, inside = sum(s["nic"] for s in sent), sum(s["loopback"] for s in sent)
    assert abs(between - nodes * ring) <= 0.05 * nodes * ring, (between, nodes * ring, sent)
    in_node_hops = ranks - nodes
    assert abs(inside - in_node_hops * ring) <= 0.05 * in_node_hops * ring, (inside, in_node_hops * ring, sent)
    # every node sends its share, one boundary each (node 0 also carries Horovod's coordinator: 10%)
    for s in sent:
        assert abs(s["nic"] - ring) <= 0.10 * ring, sent


def test_a_failing_rank_ends_the_job_with_its_exit_code():
    code, _ = nodelab.run(2, 1, [sys.executable, "-c", "import os, sys, time; "
                                 "sys.exit(3) if os.environ['HOROVOD_RANK'] == '1' else time.sleep(60)"],
                          timeout=30)
    assert code == 3


def test_a_failing_node_under_torchrun_takes_the_other_workers_with_it():
    """A worker that fails on node 1 ends the job; the workers still running (under their torchrun agents) are
    killed with their agents, not left behind."""
    import subprocess
    import uuid
    tag = f"hq-orphan-{uuid.uuid4().hex[:8]}"
    code, _ = nodelab.run(2, 1, [sys.executable, "-c", "import os, sys, time; "
                                 "sys.exit(5) if os.environ['GROUP_RANK'] == '1' else time.sleep(120)", tag],
                          launcher="torchrun", timeout=60)
    assert code != 0
    left = subprocess.run(["pgrep", "-f", tag], capture_output=True, text=True).stdout.split()
    assert not left, f"workers left running: {left}"


@pytest.mark.parametrize("fixed", [False, True])
def test_a_rendezvous_scope_is_cleared_even_when_another_one_finishes_first(fixed):
    """Horovod's rendezvous handler forgets every scope's finished ranks when one scope finishes, so a scope whose
    last rank is late keeps its keys (a later hvd.init() in the job reads them); nodelab's handler clears it."""
    import urllib.error
    import urllib.request
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousServer

    server = RendezvousServer(verbose=0)
    port = server.start(handler_cls=nodelab.rendezvous_handler() if fixed else RendezvousHandler)
    try:
        server.init(get_host_assignments(parse_hosts("node0:2,node1:2"), 4))

        def request(method, scope, key, body=None):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/{scope}/{key}", data=body, method=method)
            try:
                with urllib.request.urlopen(req, timeout=10) as response:
                    return response.status
            except urllib.error.HTTPError as error:
                return error.code

        for rank in range(4):
            assert request("PUT", "global", str(rank), b"address") == 200
        for local_rank in range(2):
            assert request("PUT", "local_node0", str(local_rank), b"address") == 200
        for rank in range(3):  # rank 3 is late to finish the global scope ...
            request("DELETE", "global", str(rank))
        for local_rank in range(2):  # ... while node 0's ranks finish theirs
            request("DELETE", "local_node0", str(local_rank))
        assert request("GET", "local_node0", "0") == 404
        request("DELETE", "global", "3")
        assert request("GET", "global", "0") == (404 if fixed else 200)  # Horovod's keeps the stale key
    finally:
        server.stop()
