"""The examples for PyTorch Lightning and Hugging Face Accelerate, run with the real packages (the test extra pins
them) on 2 CPU ranks under torchrun (Gloo), in one launch: parameters equal on every rank, the bytes and counts
our compressors report, the final validation loss within LOSS_TOLERANCE of the same script uncompressed, and
what each package does with our hooks where it departs from what a user expects (Lightning registers a strategy's
hook on CUDA only; Accelerate ignores FSDP on CPU processes): a release that changes it turns a test red."""
import importlib.util
import os
import warnings

import pytest

SHARED_LAUNCHES = True  # one torchrun launch for the module (tests/multirank.py)
ON_2 = pytest.mark.ranks(2, timeout=600, launcher="torchrun")
EPOCHS = "4"
# The final validation cross-entropy of a compressed run may differ from the uncompressed one by this much (nats).
# Measured at 4 epochs, seed 0 (2 ranks): QSGD-4 within 0.01 of float32 under DDP, QSGD-4 within
# 0.01 under FSDP2, DiLoCo QSGD-4 within 0.02 of DiLoCo float32; the study's tolerance (0.02) leaves room only
# for that: a hook that drops or doubles the gradient ends tenths of a nat away.
LOSS_TOLERANCE = 0.02
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


def _example(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _every_rank(dist, value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _same_parameters_on_every_rank(dist, summary, what):
    digests = _every_rank(dist, summary["parameters_sha256"])
    assert len(set(digests)) == 1, f"{what}: the ranks' parameters differ: {digests}"


def _step_bytes(state):
    """What one rank's hook sends per step for the digits MLP at 2 ranks (one DDP bucket, an allgather): the
    weights of 64x256 and 256x256 as one payload (QSGD: each a scale of its own; Top-k: k of their sum), the
    parameters below min_numel (10,000: the biases and the 256x10 weight) in float32."""
    return state.codec.max_payload_nbytes(64 * 256 + 256 * 256) + 4 * (256 + 256 + 2560 + 10)


@ON_2
def test_lightning_ddp_callback_compresses_every_step_and_trains_like_float32(dist_gloo):
    example = _example("lightning_digits")
    runs = {c: example.main(["--compression", c, "--epochs", EPOCHS]) for c in ("none", "qsgd", "topk")}
    for name, run in runs.items():
        _same_parameters_on_every_rank(dist_gloo, run, name)
    # Top-k 1% lags over so few steps (0.35 nats behind at 92): its loss is not compared, its bytes are
    assert abs(runs["qsgd"]["val_loss"] - runs["none"]["val_loss"]) <= LOSS_TOLERANCE, runs
    steps = runs["qsgd"]["global_step"]
    assert steps == runs["none"]["global_step"] > 0
    for name in ("qsgd", "topk"):
        stats = runs[name]["stats"]
        # one DDP bucket per step, through our hook: Lightning's own DDPStrategy would have left it at 0 on CPU
        assert stats["tensors_compressed"] == steps, (name, stats)
        logged = runs[name]["logged"]
        every = 10  # the example's log_every_n_steps: the last logged value is the count at a multiple of it
        assert logged["compression/tensors_compressed"] == steps // every * every, (name, logged)
    from horovod_qsgd.ddp import QSGDState, TopKState
    assert runs["qsgd"]["stats"]["bytes_sent"] == steps * _step_bytes(QSGDState(bits=4)), runs["qsgd"]["stats"]
    assert runs["topk"]["stats"]["bytes_sent"] == steps * _step_bytes(TopKState(ratio=0.01)), runs["topk"]["stats"]


@ON_2
def test_lightning_registers_a_strategy_hook_on_cuda_only_and_the_callback_does_it_on_cpu(dist_gloo):
    """Lightning 2.6's DDPStrategy(ddp_comm_hook=...) on CPU: no hook, no warning (the issue's finding). With
    the callback beside it: a warning that names it, and the hook compresses every step."""
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    from horovod_qsgd.ddp import QSGDState, qsgd_hook
    from horovod_qsgd.lightning import GradientCompression
    example = _example("lightning_digits")
    args = example.parse_args(["--epochs", "1"])
    train, test = example.data()

    def fit(callbacks):
        state = QSGDState(bits=4)
        strategy = DDPStrategy(process_group_backend="gloo", ddp_comm_state=state, ddp_comm_hook=qsgd_hook)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                            callbacks=[c(state) for c in callbacks], enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(example.DigitsMLP(args), train, test)
        ours = [str(w.message) for w in caught if "horovod_qsgd" in str(w.message)]
        return state.compression_stats()["tensors_compressed"], trainer.global_step, ours

    compressed, steps, said = fit([])
    assert steps > 0 and compressed == 0 and not said, (compressed, steps, said)
    compressed, steps, said = fit([GradientCompression])
    assert compressed == steps > 0
    assert len(said) == 1 and "did not register DDPStrategy(ddp_comm_hook=...) on cpu" in said[0], said


@ON_2
def test_lightning_checkpoint_keeps_every_ranks_residuals_and_refuses_another_world_size(dist_gloo):
    import torch

    from horovod_qsgd.ddp import TopKState
    from horovod_qsgd.lightning import GradientCompression
    dist = dist_gloo
    rank = dist.get_rank()
    module = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(200, 100))
    callback = GradientCompression(TopKState(ratio=0.01))
    module.register_comm_hook(callback.state, callback.hook)
    torch.manual_seed(rank)
    module(torch.randn(8, 200)).square().sum().backward()  # residuals differ between the ranks
    saved = callback.state_dict()
    mine = callback.state.state_dict()
    assert len(saved["ranks"]) == 2
    assert all(torch.equal(a, b) for a, b in zip(saved["ranks"][rank]["residuals"].values(),
                                                mine["residuals"].values()))
    assert not all(torch.equal(a, b) for a, b in zip(saved["ranks"][0]["residuals"].values(),
                                                    saved["ranks"][1]["residuals"].values()))
    fresh = GradientCompression(TopKState(ratio=0.01))
    fresh.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state.state_dict()["residuals"].values(),
                                                mine["residuals"].values()))
    with pytest.raises(ValueError, match="holds the hook states of 3 ranks, this job has 2: resume on 3 ranks"):
        fresh.load_state_dict({"ranks": saved["ranks"] + saved["ranks"][:1]})


@ON_2
def test_lightning_fsdp2_callback_installs_the_compressed_reduce_scatter(dist_gloo):
    example = _example("lightning_digits")
    runs = {c: example.main(["--strategy", "fsdp2", "--compression", c, "--epochs", EPOCHS]) for c in ("none", "qsgd")}
    for name, run in runs.items():
        _same_parameters_on_every_rank(dist_gloo, run, f"fsdp2 {name}")
    assert abs(runs["qsgd"]["val_loss"] - runs["none"]["val_loss"]) <= LOSS_TOLERANCE, runs
    stats, steps = runs["qsgd"]["stats"], runs["qsgd"]["global_step"]
    # every step, the reduce-scatters of the two large Linears; the 256x10 one (2,570 values, below min_numel)
    # goes through FSDP2's own
    assert stats["tensors_compressed"] == 2 * steps and stats["tensors_passed_through"] == steps, stats
    # 4 bits and a scale per 512 values, beside the small module's float32 rows: 6.4x measured, the same each step
    assert 6 < stats["compression_ratio"] < 8 and stats["bytes_sent"] % steps == 0, stats


@ON_2
def test_lightning_diloco_with_local_steps_callback(dist_gloo):
    import lightning as L
    example = _example("lightning_digits")
    warmup, every = 16, 8  # the example's defaults
    local = warmup + every + 3  # three local steps after the first outer step

    class Probe(L.Callback):
        """Whether the ranks' parameters differ after a local step: DDP must not have averaged the gradients."""
        differ = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == local:
                sums = tuple(p.sum().item() for p in pl_module.parameters())
                Probe.differ = len(set(_every_rank(dist_gloo, sums))) > 1

    runs = {c: example.main(["--diloco", "--compression", c, "--epochs", EPOCHS], [Probe()]) for c in ("none", "qsgd")}
    assert Probe.differ is True, "the ranks' parameters were equal after a local step: DDP averaged the gradients"
    for name, run in runs.items():
        _same_parameters_on_every_rank(dist_gloo, run, f"diloco {name}")  # averaged at the end of training
    assert abs(runs["qsgd"]["val_loss"] - runs["none"]["val_loss"]) <= LOSS_TOLERANCE, runs
    stats, steps = runs["qsgd"]["stats"], runs["qsgd"]["global_step"]
    assert stats["warmup_steps"] == warmup and stats["outer_steps"] == (steps - warmup) // every, stats
    # DDP sent nothing: every byte is DiLoCo's (warm-up and outer steps compressed, models averaged in full)
    assert stats["models_averaged"] >= 1 and stats["compression_ratio"] > 2, stats


@ON_2
def test_accelerate_hook_after_prepare_compresses_every_step_and_trains_like_float32(dist_gloo):
    example = _example("accelerate_digits")
    runs = {c: example.main(["--compression", c, "--epochs", EPOCHS]) for c in ("none", "qsgd")}
    for name, run in runs.items():
        _same_parameters_on_every_rank(dist_gloo, run, f"accelerate {name}")
    assert abs(runs["qsgd"]["val_loss"] - runs["none"]["val_loss"]) <= LOSS_TOLERANCE, runs
    steps = int(EPOCHS) * 23  # 1437 training examples, 719 per rank, batches of 32
    assert runs["qsgd"]["stats"]["tensors_compressed"] == steps
    from horovod_qsgd.ddp import QSGDState
    assert runs["qsgd"]["stats"]["bytes_sent"] == steps * _step_bytes(QSGDState(bits=4))


@ON_2
def test_accelerate_ignores_fsdp_on_cpu_processes_and_the_example_says_so(dist_gloo):
    example = _example("accelerate_digits")
    with pytest.raises(SystemExit, match="Accelerate chose DistributedType.MULTI_CPU and ignored the FSDP plugin"):
        example.main(["--fsdp2", "--epochs", "1"])


@ON_2
def test_lightning_resume_gives_each_rank_its_own_residuals_through_trainer_checkpoints(dist_gloo):
    """trainer.save_checkpoint on every rank, then fit(ckpt_path=...) with a new callback: each rank's Top-k
    residuals are the ones it saved (the checkpoint rank 0 wrote holds both ranks')."""
    import tempfile

    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    from horovod_qsgd.ddp import TopKState
    from horovod_qsgd.lightning import GradientCompression
    example = _example("lightning_digits")
    args = example.parse_args(["--compression", "topk"])
    train, test = example.data()
    where = [tempfile.mkdtemp(prefix="hq-lightning-") if dist_gloo.get_rank() == 0 else None]
    dist_gloo.broadcast_object_list(where, 0)
    path = os.path.join(where[0], "last.ckpt")

    def trainer(epochs, callback, probe=()):
        return L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="gloo"),
                         max_epochs=epochs, callbacks=[callback, *probe], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)

    first = GradientCompression(TopKState(ratio=0.01))
    run = trainer(1, first)
    run.fit(example.DigitsMLP(args), train, test)
    run.save_checkpoint(path)
    saved = {k: v.clone() for k, v in first.state.state_dict()["residuals"].items()}
    assert saved and len(set(_every_rank(dist_gloo, float(sum(v.abs().sum() for v in saved.values()))))) == 2

    class Probe(L.Callback):
        loaded = None

        def on_fit_start(self, trainer, pl_module):  # after the checkpoint was restored, before any step
            Probe.loaded = {k: v.clone() for k, v in second.state.state_dict()["residuals"].items()}

    second = GradientCompression(TopKState(ratio=0.01))
    trainer(2, second, [Probe()]).fit(example.DigitsMLP(args), train, test, ckpt_path=path)
    assert set(Probe.loaded) == set(saved) and all(torch.equal(Probe.loaded[k], saved[k]) for k in saved)
