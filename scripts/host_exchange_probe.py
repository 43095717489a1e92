"""Host cost of each step of the weave backend's routing exchange (2 GPUs), to find the 1 ms."""

import time

import torch

from weave_moe.testing import run_distributed


def worker(rank, world_size):
    import torch.distributed as dist

    from weave_moe.backends.weave.layout import count_routing

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    k, max_tokens, E = 8, 8192, 128
    words = 2 * max_tokens * k + 1
    send = torch.empty(words, dtype=torch.int32, device=device)
    gathered = torch.empty(world_size, words, dtype=torch.int32, device=device)
    ids = torch.randint(0, E, (8192, k), dtype=torch.int32, device=device)
    w = torch.rand(8192, k, device=device)
    group = dist.group.WORLD
    steps = {}

    def lap(name, t0):
        t1 = time.perf_counter()
        steps[name] = steps.get(name, 0.0) + (t1 - t0) * 1e3
        return t1

    for it in range(30):
        if it == 10:
            steps.clear()
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        send[: max_tokens * k].fill_(-1)
        t = lap("fill", t)
        send[: 8192 * k].copy_(ids.reshape(-1))
        send[max_tokens * k: max_tokens * k + 8192 * k].copy_(w.reshape(-1).view(torch.int32))
        send[-1:].fill_(8192)
        t = lap("copies", t)
        dist.all_gather_into_tensor(gathered, send, group=group)
        t = lap("all_gather", t)
        all_ids = gathered[:, : max_tokens * k].view(world_size, max_tokens, k)
        counts = count_routing(all_ids, gathered[:, -1], E)
        t = lap("count_routing", t)
        counts.tolist()
        t = lap("tolist", t)
    return {k: v / 20 for k, v in steps.items()}


if __name__ == "__main__":
    for rank, steps in enumerate(run_distributed(worker, 2, backend="nccl", timeout_s=200)):
        print(rank, {k: round(v, 3) for k, v in steps.items()})
