"""PyTorch DDP (gloo) on the throughput benchmark's MLP; the reference to beat.

    python torch_ddp.py WORKERS STEPS    -> prints examples/sec (rank 0)

Same model (784-1024-1024-10), global batch 512, SGD, one thread per process,
random data generated once per process (data loading is not measured).
"""

import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GLOBAL_BATCH = 512


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(rank: int, workers: int, steps: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    if workers > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=workers)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 10))
    if workers > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = GLOBAL_BATCH // workers
    x, y = torch.rand(batch, 784), torch.randint(0, 10, (batch,))
    for step in range(steps):
        if step == 1:
            start = time.perf_counter()  # the first step warms up, as in tfdist's figure
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    rate = (steps - 1) * GLOBAL_BATCH / (time.perf_counter() - start)
    if rank == 0:
        queue.put(rate)
    if workers > 1:
        # Both ranks reach the teardown together: gloo aborted one rank
        # ("terminate called without an active exception") when the other tore down first.
        dist.barrier()
        dist.destroy_process_group()


def main(workers: int, steps: int) -> None:
    queue = mp.get_context("spawn").SimpleQueue()
    port = free_port()
    mp.start_processes(train, args=(workers, steps, port, queue), nprocs=workers,
                       start_method="spawn")
    print(queue.get())


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
