"""PyTorch pieces that serve more than one adapter, none of which imports Horovod.

- ``arrays``: torch tensors as kernel arrays, a conduct's buffers, the kernels' CUDA stream;
- ``feedback``: the error-feedback store in torch tensors (Horovod's compressors per tensor, FSDP2's per module);
- ``distributed``: the engine's collectives over ``torch.distributed`` (the DDP hooks, FSDP2, DiLoCo's
  torch.distributed form);
- ``local_sgd``: DiLoCo's outer loop (anchor, outer Nesterov step, schedule, checkpoint), for
  :mod:`horovod_qsgd.torch` and :mod:`horovod_qsgd.ddp` alike.
"""
