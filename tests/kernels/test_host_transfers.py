"""The CUDA path's synchronous host copies per call, counted in numba's simulator (issue #14's bounds)."""

import json

import pytest


@pytest.fixture(scope="module")
def report(simulator_runs):
    code, out, err = simulator_runs["transfers"].result()  # transfers_check.py in the simulator (conftest.py)
    assert code == 0, out[-3000:] + err[-3000:]
    counts = json.loads(out.strip().splitlines()[-1])
    for name, entry in counts.items():
        print(f"{name:>55}: {entry}")
    return counts


def test_every_counted_call_gives_the_cpu_result(report):
    assert {name for name, entry in report.items() if not entry["matches_cpu"]} == set()


@pytest.mark.parametrize("call", ["qsgd-4 encode", "qsgd-4 fp16 scales encode"])
def test_qsgd_encode_copies_nothing_between_host_and_device(report, call):
    # a step after the layout's first: two launches (the grouped kernels, header and padding included)
    assert (report[call]["h2d"], report[call]["d2h"], report[call]["launch"]) == (0, 0, 2)


# The bound is one read per top-k encode; every choice now runs on the device, so none.
@pytest.mark.parametrize("call", ["topk-1% encode", "topk-5% encode (sampled candidates)", "gaussiank-1% encode",
                                  "sample-k 1% encode", "on a stream: topk-1% encode",
                                  "on a stream: gaussiank-1% encode", "on a stream: randomk-1% fp16 encode"])
def test_sparse_encode_copies_nothing_between_host_and_device(report, call):
    assert (report[call]["h2d"], report[call]["d2h"]) == (0, 0)


def test_elias_encode_reads_back_only_its_length(report):
    # a variable-length payload: the host needs its length (the bucket ends are summed on the device)
    entry = report["on a stream: qsgd-4 elias encode"]
    assert (entry["h2d"], entry["d2h"]) == (0, 1)


@pytest.mark.parametrize("case", ["whole", "cut", "not advancing"])
def test_a_header_chain_is_read_in_one_copy(report, case):
    entry = report[f"header chain of 3 elias payloads, {case}"]
    assert (entry["h2d"], entry["d2h"]) == (0, 1)


@pytest.mark.parametrize("group", ["qsgd-4 encode_many of 5 tensors", "qsgd-3 fp16 scales encode_many of 3 tensors"])
def test_a_group_of_payloads_takes_two_launches_and_copies_its_layout_once(report, group):
    """Issue #51: QSGD's payloads of a group (here 5 tensors of 1 to 20,000 elements) take a scale launch and a
    code launch for all, not launches per tensor; the table that lays them out is copied to the device at the
    layout's first step only."""
    first, following = report[f"{group}, first step"], report[f"{group}, next step"]
    assert (first["launch"], first["h2d"], first["d2h"]) == (2, 1, 0)
    assert (following["launch"], following["h2d"], following["d2h"]) == (2, 0, 0)


@pytest.mark.parametrize("group, launches", [("topk-5% encode_many of 5 tensors", 11),
                                             ("topk-5% fp16 encode_many of 3 tensors", 11),
                                             ("topk-5% without error feedback, encode_many of 2 tensors", 10)])
def test_a_group_of_top_k_payloads_takes_one_launch_sequence(report, group, launches):
    """Issue #51: exact top-k's selections of a group (tensors of 1 to 20,000 elements, each its own k and
    residual, carried residuals among them) take one sequence: init, accumulate (with error feedback), three
    histogram + digit launches, count, scan, write. The step after a layout's first copies nothing, though the
    carried residuals' stamps advanced."""
    first, following = report[f"{group}, first step"], report[f"{group}, next step"]
    assert (first["launch"], first["h2d"], first["d2h"]) == (launches, 1, 0)
    assert (following["launch"], following["h2d"], following["d2h"]) == (launches, 0, 0)


@pytest.mark.parametrize("group, launches", [
    ("gaussiank-5% encode_many of 5 tensors", 22),
    ("gaussiank-5% fp16 encode_many of 3 tensors, one not finite", 22),
    ("gaussiank-5% without error feedback, encode_many of 2 tensors", 21),
    ("sample-k 5% encode_many of 5 tensors", 29),
    ("sample-k 5% fp16 encode_many of 3 tensors, one not finite", 29),
    ("sample-k 5% without error feedback, encode_many of 2 tensors", 28)])
def test_a_group_of_threshold_selections_takes_one_launch_sequence(report, group, launches):
    """Issue #51: Gaussian-k's and sample-k's selections of a group take one sequence whatever the tensor count.
    Both: init, accumulate (with error feedback), then the first thresholds, four rounds of count and refinement,
    the exact fallback's three histogram + digit launches (they return at once for a tensor whose first
    threshold was finite; the cases with an inf and a NaN run them for that tensor inside the group), count,
    scan, write, pad. Gaussian-k's first thresholds: moments and threshold (22 launches); sample-k's: the
    samples' gather, their own init and three radix passes, threshold (29). The first step of a layout copies
    two tables (the layout; Gaussian-k's z or sample-k's samples' layout), the next step nothing. The bytes and
    residuals are the CPU's one-by-one encodes (every other tensor heavy-tailed, so thresholds refine)."""
    first, following = report[f"{group}, first step"], report[f"{group}, next step"]
    assert (first["launch"], first["h2d"], first["d2h"]) == (launches, 2, 0)
    assert (following["launch"], following["h2d"], following["d2h"]) == (launches, 0, 0)


def test_a_tensors_slices_for_the_owners_take_two_launches(report):
    assert {k: report["qsgd-4 two stages: slices for 3 owners"][k] for k in ("launch", "h2d", "d2h")} == \
        {"launch": 2, "h2d": 0, "d2h": 0}


@pytest.mark.parametrize("call", ["qsgd-4 decode of 3 ranks", "qsgd-8 decode of 3 ranks",
                                  "qsgd-4 two stages: sum of the first stage's slices",
                                  "qsgd-4 two stages: decode of the second stage's sums",
                                  "on a stream: qsgd-4 decode of 3 ranks"])
def test_qsgd_decodes_every_payload_in_one_launch(report, call):
    # one decode for all payloads and one gather of their headers
    assert report[call]["launch"] == 2


BUDGETS = [f"budget {model}, threshold {mib} MiB" for model in ("resnet50", "gpt2-small") for mib in (64, 4, 1)]


@pytest.mark.parametrize("case", BUDGETS)
def test_the_codecs_cost_per_step_grows_with_the_groups_not_the_tensors(report, case):
    """Issue #51's launch budget, for the ~50 compressed gradients of ResNet-50 and GPT-2 small (the shapes in
    horovod_qsgd/testdata/model_shapes.py), QSGD-4 on rank 0 of 4, fused as the adapters fuse them (fusion thresholds of 64, 4 and
    1 MiB of payload; at 1 MiB nearly every tensor is a group of its own). Per group and step: 2 launches
    encode its payloads, 1 walks its 4 parts' manifests, 1 gathers every payload's header, 1 decodes them all,
    plus the walk's scratch cleared: 6 launches; 2 host reads (the manifests, the headers); no host copy to the
    device once the layouts are known. Before, every tensor paid 5 launches to encode and 2 to decode."""
    entry = report[case]
    assert entry["matches_cpu"]
    assert entry["tensors"] in (52, 50)
    assert entry["launch"] == 6 * entry["groups"]
    assert (entry["d2h"], entry["h2d"]) == (2 * entry["groups"], 0)


@pytest.mark.parametrize("model, groups", [("resnet50", 5), ("gpt2-small", 17)])
def test_the_pytorch_adapters_allgather_groups_on_a_gpu_keep_the_budget(report, model, groups):
    """The same budget for the groups the PyTorch Horovod adapter forms of its allgather tensors on a GPU (at
    most 25 MiB of float32 gradient each, in name order): ResNet-50's 52 compressed tensors in 5 groups,
    GPT-2 small's 50 in 17 (most of its tensors are 2.4-9 MiB of gradient), 6 launches and 2 host reads each."""
    entry = report[f"budget {model}, allgather groups, threshold 25 MiB"]
    assert entry["matches_cpu"]
    assert (entry["groups"], entry["launch"], entry["d2h"], entry["h2d"]) == (groups, 6 * groups, 2 * groups, 0)


def test_top_k_costs_per_group_and_sender_not_per_tensor(report):
    """The same budget for Top-k 1% (exact, error feedback), ResNet-50's 52 compressed gradients in one group
    (64 MiB): 11 launches select and write every payload, the decode adds the 4 ranks' parts in 4 launches (a
    round per sender: the i-th payload of every tensor in round i), and the manifests' walk, the header
    gather, the fault counters and the walk's scratch take 4: 19 launches, 2 host reads. One by one, each
    tensor takes 12 to 23 launches to encode and 5 to decode. (GPT-2 small's 50, once: the same 19.)"""
    entry = report["budget resnet50, top-k 1%, threshold 64 MiB"]
    assert entry["matches_cpu"]
    assert (entry["tensors"], entry["groups"]) == (52, 1)
    assert (entry["launch"], entry["d2h"], entry["h2d"]) == (11 + 4 + 4, 2, 0)


def test_one_group_costs_the_same_whatever_its_tensor_count(report):
    """ResNet-50's 52 compressed tensors and GPT-2 small's 50 each fit one group at Horovod's default fusion
    threshold (64 MiB): the same 6 launches and 2 host reads a step."""
    for model in ("resnet50", "gpt2-small"):
        entry = report[f"budget {model}, threshold 64 MiB"]
        assert (entry["groups"], entry["launch"], entry["d2h"]) == (1, 6, 2)


@pytest.mark.parametrize("call", ["qsgd-4 decode of 3 ranks", "qsgd-8 decode of 3 ranks",
                                  "qsgd-4 two stages: sum of the first stage's slices",
                                  "qsgd-4 two stages: decode of the second stage's sums",
                                  # the headers and every payload's index check in the same read
                                  "topk-1% decode of 3 ranks", "on a stream: gaussiank-1% decode of 3 ranks",
                                  # random-k's index stream comes from each payload's step and key, on the device
                                  "randomk-1% decode of 3 ranks", "on a stream: randomk-1% fp16 decode of 3 ranks",
                                  # variable-size payloads: decoded where the device finds them by following
                                  # the header chain; the chain's headers and every bucket's checks in one read
                                  "on a stream: qsgd-4 elias decode of 3 ranks"])
def test_decoding_all_ranks_payloads_reads_the_device_once(report, call):
    assert report[call]["h2d"] == 0
    assert report[call]["d2h"] <= 1


def test_every_launch_allocation_and_copy_goes_to_the_callers_stream(report):
    on_a_stream = {name: entry for name, entry in report.items() if name.startswith("on a stream:")}
    assert len(on_a_stream) == 13 and all(entry["launch"] > 0 for entry in on_a_stream.values())
    assert {name: entry["off_stream"] for name, entry in report.items() if entry["off_stream"]} == {}


def test_scratch_comes_from_the_callers_allocator_when_it_names_one(report):
    on_a_stream = {name: entry for name, entry in report.items() if name.startswith("on a stream:")}
    assert {name: entry["alloc"] for name, entry in on_a_stream.items() if entry["alloc"]} == {}
    assert sum(entry["allocator"] for entry in on_a_stream.values()) >= 20
    assert all(entry["allocator"] == 0 for name, entry in report.items() if name not in on_a_stream)


SETTLED = ["topk-1% settled", "topk-5% settled (sampled candidates)", "gaussiank-1% settled", "randomk-1% settled"]


@pytest.mark.parametrize("case", SETTLED)
def test_a_step_that_may_not_count_costs_no_extra_pass_and_no_host_read_on_a_device(report, case):
    """Issue #49: a step reads the residual through a CarriedResidual (no copy) and its verdict is stamped by the
    pass that scales the result (no check, no torch.where, no host read): the carried encode launches exactly the
    in-place encode's kernels, the finish is one kernel, and nothing crosses between host and device."""
    steps = [name for name in report if name.startswith(case + " step ")]
    assert len(steps) == 12
    for step in range(4):
        carried = report[f"{case} step {step}: carried encode"]
        in_place = report[f"{case} step {step}: in-place encode"]
        finish = report[f"{case} step {step}: finish"]
        assert carried["launch"] == in_place["launch"]
        assert (carried["h2d"], carried["d2h"], finish["h2d"], finish["d2h"], finish["launch"]) == (0, 0, 0, 0, 1)


@pytest.mark.parametrize("case", SETTLED)
def test_the_device_keeps_what_the_host_keeps_through_non_finite_steps(report, case):
    """Every payload, the residual after 4 steps (one or two of them non-finite, decided on the device by the
    stamps) and the non-finite count equal the CPU's, which copies the residual and decides on the host."""
    entry = report[f"{case}: after 4 steps"]
    assert entry["nonfinite"] >= 1 and entry["matches_cpu"]
