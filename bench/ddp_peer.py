#!/usr/bin/env python3
"""PyTorch's DistributedDataParallel over gloo, the peer of gradavg_bench_mpi on the same layouts.

One process per rank, started with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT; GLOO_SOCKET_IFNAME names the link's interface), e.g. by
`scripts/netlink.sh each python3 bench/ddp_peer.py --model resnet50` (scripts/bench-mpi.sh --ddp).

The model holds float parameters of ResNet-50's or BERT-base's shapes (bench/model_shapes.hpp, in
the same order); a step is a forward that reads one element of every parameter and a backward
whose gradients (dense, every element) DDP averages in its buckets while backward runs. Methods,
rounds interleaved like gradavg_bench_mpi's:
  ddp            DDP's default allreduce hook (25 MiB buckets)
  ddp_fp16_hook  DDP with torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook
  backward       the same step without DDP (the local work the exchange could hide behind)
A method's time in a round is the slowest rank's; a point is the median over --rounds rounds,
after one warm-up round. Rank 0 prints one line per model.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel


def resnet50_shapes():
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    blocks, widths, cin = (3, 4, 6, 3), (64, 128, 256, 512), 64
    for stage in range(4):
        w = widths[stage]
        out = 4 * w
        for b in range(blocks[stage]):
            shapes += [(w, cin, 1, 1), (w,), (w,), (w, w, 3, 3), (w,), (w,), (out, w, 1, 1), (out,), (out,)]
            if b == 0:
                shapes += [(out, cin, 1, 1), (out,), (out,)]
            cin = out
    shapes += [(1000, 2048), (1000,)]
    return shapes


def bert_base_shapes():
    h, f = 768, 3072
    shapes = [(30522, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(12):
        for _ in range(3):
            shapes += [(h, h), (h,)]
        shapes += [(h, h), (h,), (h,), (h,), (f, h), (f,), (h, f), (h,), (h,), (h,)]
    shapes += [(h, h), (h,)]
    return shapes


MODELS = {"resnet50": (resnet50_shapes, 161, 25_557_032), "bert_base": (bert_base_shapes, 199, 109_482_240)}


class Layout(torch.nn.Module):
    """Parameters of the given shapes; forward reads one element of each."""

    def __init__(self, shapes):
        super().__init__()
        self.params = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(s)) for s in shapes)

    def forward(self, x):
        total = x
        for p in self.params:
            total = total + p.view(-1)[0] * x
        return total.sum()


def slowest_ms(f):
    dist.barrier()
    start = time.perf_counter()
    f()
    ms = torch.tensor([(time.perf_counter() - start) * 1e3], dtype=torch.float64)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


def run_model(name, rounds):
    make, tensors, params = MODELS[name]
    shapes = make()
    plain = Layout(shapes)
    count = sum(p.numel() for p in plain.parameters())
    assert len(shapes) == tensors and count == params, (name, len(shapes), count)
    ddp = DistributedDataParallel(Layout(shapes))
    ddp_fp16 = DistributedDataParallel(Layout(shapes))
    ddp_fp16.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    x = torch.ones(4)

    def step(model):
        def f():
            model.zero_grad(set_to_none=False)
            model(x).backward()
        return f

    methods = [("ddp", step(ddp)), ("ddp_fp16_hook", step(ddp_fp16)), ("backward", step(plain))]
    times = {m: [] for m, _ in methods}
    for r in range(rounds + 1):
        for i in range(len(methods)):
            m, f = methods[(i + r) % len(methods)]
            ms = slowest_ms(f)
            if r > 0:
                times[m].append(ms)
    med = {m: statistics.median(t) for m, t in times.items()}
    if dist.get_rank() == 0:
        cells = "  ".join(f"{m} {med[m]:.3g} [{min(times[m]):.3g}-{max(times[m]):.3g}]" for m, _ in methods)
        print(f"{name:9s} ddp over gloo, {dist.get_world_size()} ranks, {count} floats:  {cells} ms", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50", choices=["resnet50", "bert_base", "all"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    for name in MODELS:
        if args.model in ("all", name):
            run_model(name, args.rounds)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
