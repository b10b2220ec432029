"""One rank of tests/test_nodelab.py: reports where it runs and allreduces 1M fp32 (``horovod`` or ``torch``)."""
import json
import os
import sys

import torch

NUMEL = 1_000_000


def main(launcher, out_dir):
    if launcher == "horovodrun":
        import horovod.torch as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        where = dict(local_rank=hvd.local_rank(), local_size=hvd.local_size(), cross_rank=hvd.cross_rank(),
                     cross_size=hvd.cross_size())
        total = hvd.allreduce(torch.full((NUMEL,), float(rank)), op=hvd.Sum, name="probe")
        hvd.allreduce(torch.zeros(1), name="done")
    else:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        where = dict(local_rank=int(os.environ["LOCAL_RANK"]), local_size=int(os.environ["LOCAL_WORLD_SIZE"]),
                     cross_rank=int(os.environ["GROUP_RANK"]), cross_size=size // int(os.environ["LOCAL_WORLD_SIZE"]))
        total = torch.full((NUMEL,), float(rank))
        dist.all_reduce(total)
        dist.barrier()
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(dict(where, rank=rank, size=size, total=sorted(set(total.tolist()))), f)


if __name__ == "__main__":
    main(*sys.argv[1:])
