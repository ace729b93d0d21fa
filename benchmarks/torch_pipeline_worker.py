"""PyTorch's pipeline and tensor parallelism on CPU (gloo), the contenders of torch_pipeline.py.

    python torch_pipeline_worker.py pipeline SCHEDULE PROCS STEPS INPUT HIDDEN BATCH MICROBATCHES
    python torch_pipeline_worker.py tp PROCS STEPS INPUT FFN BATCH
        -> prints examples/sec (rank 0), timed from the end of the first step

pipeline: the MLP INPUT-HIDDEN-...-10 (HIDDEN comma-separated, relu after each hidden
layer) cut into PROCS stages where tfdist's balancer cuts it (equal parameter counts, the
logits with the last stage), one stage per process, under torch.distributed.pipelining
(PipelineStage, ScheduleGPipe or Schedule1F1B), BATCH split into MICROBATCHES.
tp: Megatron's MLP block INPUT-FFN-INPUT-10 with torch.distributed.tensor.parallel:
the first Linear ColwiseParallel, the second RowwiseParallel (one all-reduce forward,
one backward), the logits replicated; every process sees the whole batch.
SGD, one thread per process, one fixed random batch per process (no input pipeline).
"""

import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NUM_CLASSES = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mlp_layers(input_dim: int, hidden) -> list:
    """[(Linear, relu?)] in order; the logits last, without an activation."""
    widths = [input_dim, *hidden]
    layers = [torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    return layers + [torch.nn.Linear(widths[-1], NUM_CLASSES)]


def balanced_cut(layers, stages: int) -> list:
    """Stage boundaries minimising the largest stage's parameter count (tfdist's cost model)."""
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    best = None

    def search(start, left, cuts):
        nonlocal best
        if left == 1:
            cuts = cuts + [len(layers)]
            edges = [0] + cuts
            cost = max(sum(sizes[a:b]) for a, b in zip(edges, edges[1:]))
            if best is None or cost < best[0]:
                best = (cost, cuts)
            return
        for end in range(start + 1, len(layers) - left + 2):
            search(end, left - 1, cuts + [end])

    search(0, stages, [])
    return [0] + best[1]


def stage_module(layers, begin: int, end: int) -> torch.nn.Sequential:
    modules = []
    for index in range(begin, end):
        modules.append(layers[index])
        if index < len(layers) - 1:
            modules.append(torch.nn.ReLU())
    return torch.nn.Sequential(*modules)


def _init(rank: int, procs: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=procs)


def _finish(rank: int, start: float, steps: int, batch: int, queue) -> None:
    rate = (steps - 1) * batch / (time.perf_counter() - start)
    if rank == 0:
        queue.put(rate)
    # Both ranks reach the teardown together: gloo aborted one rank
    # ("terminate called without an active exception") when the other tore down first.
    dist.barrier()
    dist.destroy_process_group()


def pipeline(rank, procs, port, queue, schedule, steps, input_dim, hidden, batch, microbatches):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    _init(rank, procs, port)
    torch.manual_seed(0)
    layers = mlp_layers(input_dim, hidden)
    edges = balanced_cut(layers, procs)
    module = stage_module(layers, edges[rank], edges[rank + 1])
    stage = PipelineStage(module, rank, procs, torch.device("cpu"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    runner = kind(stage, n_microbatches=microbatches,
                  loss_fn=lambda logits, y: torch.nn.functional.cross_entropy(logits, y))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    x, y = torch.rand(batch, input_dim), torch.randint(0, NUM_CLASSES, (batch,))
    last = rank == procs - 1
    start = time.perf_counter()
    for step in range(steps):
        if step == 1:
            start = time.perf_counter()   # the first step warms up, as in tfdist's figure
        optimizer.zero_grad()
        if rank == 0:
            runner.step(x)
        elif last:
            runner.step(target=y)
        else:
            runner.step()
        optimizer.step()
    _finish(rank, start, steps, batch, queue)


def tensor_parallel(rank, procs, port, queue, steps, input_dim, ffn, batch):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    _init(rank, procs, port)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(input_dim, ffn), torch.nn.ReLU(),
                                torch.nn.Linear(ffn, input_dim), torch.nn.ReLU(),
                                torch.nn.Linear(input_dim, NUM_CLASSES))
    mesh = init_device_mesh("cpu", (procs,))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.rand(batch, input_dim), torch.randint(0, NUM_CLASSES, (batch,))
    start = time.perf_counter()
    for step in range(steps):
        if step == 1:
            start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    _finish(rank, start, steps, batch, queue)


def main(argv) -> None:
    mode, args = argv[0], argv[1:]
    if mode == "pipeline":
        schedule, procs, steps, input_dim = args[0], int(args[1]), int(args[2]), int(args[3])
        hidden = [int(h) for h in args[4].split(",")]
        target = pipeline
        call = (schedule, steps, input_dim, hidden, int(args[5]), int(args[6]))
    elif mode == "tp":
        procs, steps = int(args[0]), int(args[1])
        target = tensor_parallel
        call = (steps, int(args[2]), int(args[3]), int(args[4]))
    else:
        raise SystemExit(f"mode must be pipeline or tp, not {mode!r}")
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(target, args=(procs, free_port(), queue, *call), nprocs=procs,
                       start_method="spawn")
    print(queue.get())


if __name__ == "__main__":
    main(sys.argv[1:])
