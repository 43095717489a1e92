"""The routing exchange kernel (kernels/routing_exchange.py) on ONE GPU: EP ranks emulated by streams.

    python3 scripts/routing_exchange_check.py --out $OUT/routing_exchange_check.json

Each emulated rank has its own workspace (an ordinary allocation on the same GPU) and its own stream; one peer_bases
table holds every rank's buffer. A call packs every rank's message and launches every rank's production exchange
(STAGE_BOTH) on its stream, so the ranks' kernels run concurrently and wait for each other's flags as on EP GPUs
(the peer writes go to the same GPU's memory, not over NVLink).

1. Correctness: EP 1, 2, 3, 4 at T_max 8192, k 8 (DeepSeek-V3's message), 30 calls each with random T per rank
   (0 and T_max included, often shrinking): every rank's all_routing must equal the stack of the packed messages
   bit for bit, the status word stay 0, and the sequence counter equal the call count.
2. CUDA graph: every rank's exchange captured once (one graph per rank) and replayed 20 times with new message
   contents: same checks (the parity and sequence live on the device, so replays alternate parities).
3. Timeout: EP 2, rank 1 never launches; rank 0's exchange must end with status [5, 1, seen, expected] within
   about its deadline (1 ms) plus launch time.
4. Time: median of 200 back-to-back calls of EP 1 and EP 2 (all ranks' launches, CUDA events on rank 0's stream).
Writes one JSON; prints a summary. Exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from weave_moe.backends.coordination import HEADER_WORDS
from weave_moe.backends.weave.exchange import RoutingMessage
from weave_moe.backends.weave.kernels import routing_exchange as rx
from weave_moe.backends.weave.workspace import SymmetricWorkspace

DEVICE = torch.device("cuda", 0)
TIMEOUT_NS = 10 ** 9


class Ranks:
    def __init__(self, ep: int, max_tokens: int, top_k: int):
        self.ep, self.msg = ep, RoutingMessage(max_tokens, top_k)
        self.views = [SymmetricWorkspace(None, r, ep, DEVICE).attach(max_tokens, 8, routing_words=self.msg.words)
                      for r in range(ep)]
        self.table = torch.tensor([v.workspace.buffer.data_ptr() for v in self.views], dtype=torch.int64,
                                  device=DEVICE)
        self.streams = [torch.cuda.Stream(DEVICE) for _ in range(ep)]
        self.sends = [torch.empty(self.msg.words, dtype=torch.int32, device=DEVICE) for _ in range(ep)]
        self.all_routing = [torch.empty(ep, self.msg.words, dtype=torch.int32, device=DEVICE) for _ in range(ep)]
        self.status = [torch.zeros(4, dtype=torch.int32, device=DEVICE) for _ in range(ep)]
        self.pad = self.msg.pad(DEVICE)
        self.counts = torch.arange(max_tokens + 1, dtype=torch.int32, device=DEVICE)

    def pack(self, rank: int, tokens: int, seed: int) -> None:
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        ids = torch.randint(-1, 256, (tokens, self.msg.top_k), generator=g, device=DEVICE, dtype=torch.int32)
        weights = torch.rand(tokens, self.msg.top_k, generator=g, device=DEVICE)
        header = torch.randint(0, 1 << 30, (HEADER_WORDS,), generator=g, device=DEVICE, dtype=torch.int32)
        self.msg.pack(self.sends[rank], ids, weights, self.pad, self.counts, header)

    def launch(self, ranks=None, timeout_ns: int = TIMEOUT_NS) -> None:
        current = torch.cuda.current_stream(DEVICE)
        for r in range(self.ep) if ranks is None else ranks:
            stream = self.streams[r]
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                rx.exchange_routing(self.views[r], self.msg, self.sends[r], self.all_routing[r], self.status[r],
                                    timeout_ns, peer_bases=self.table)
        for r in range(self.ep) if ranks is None else ranks:
            current.wait_stream(self.streams[r])

    def check(self, calls: int) -> list[str]:
        torch.cuda.synchronize(DEVICE)
        expected = torch.stack(self.sends)
        errors = []
        for r in range(self.ep):
            if self.status[r].tolist() != [0, 0, 0, 0]:
                errors.append(f"rank {r}: status {self.status[r].tolist()}")
            if not torch.equal(self.all_routing[r], expected):
                bad = (self.all_routing[r] != expected).nonzero()[:5].tolist()
                errors.append(f"rank {r}: all_routing differs at {bad}")
            if int(self.views[r].exchange_ctrl[0]) != calls:
                errors.append(f"rank {r}: seq {int(self.views[r].exchange_ctrl[0])}, expected {calls}")
        return errors


def check_calls(ep: int, rng: random.Random, num_calls: int = 30) -> list[str]:
    ranks = Ranks(ep, 8192, 8)
    errors = []
    for call in range(1, num_calls + 1):
        for r in range(ep):
            ranks.pack(r, rng.choice([0, 8192, rng.randrange(8192), rng.randrange(64)]), rng.randrange(1 << 30))
        ranks.launch()
        errors += [f"EP {ep} call {call}: {e}" for e in ranks.check(call)]
    # a CUDA graph per rank, replayed with new contents
    graphs = []
    for r in range(ep):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=ranks.streams[r]):
            rx.exchange_routing(ranks.views[r], ranks.msg, ranks.sends[r], ranks.all_routing[r], ranks.status[r],
                                TIMEOUT_NS, peer_bases=ranks.table)
        graphs.append(graph)
    torch.cuda.synchronize(DEVICE)
    for replay in range(1, 21):
        for r in range(ep):
            ranks.pack(r, rng.randrange(8193), rng.randrange(1 << 30))
        torch.cuda.synchronize(DEVICE)
        for r in range(ep):
            with torch.cuda.stream(ranks.streams[r]):
                graphs[r].replay()
        errors += [f"EP {ep} replay {replay}: {e}" for e in ranks.check(num_calls + replay)]
    return errors


def check_timeout() -> tuple[list[str], float]:
    ranks = Ranks(2, 128, 8)
    ranks.pack(0, 100, 1)
    ranks.pack(1, 50, 2)
    torch.cuda.synchronize(DEVICE)
    start = time.perf_counter()
    ranks.launch(ranks=[0], timeout_ns=10 ** 6)
    torch.cuda.synchronize(DEVICE)
    seconds = time.perf_counter() - start
    status = ranks.status[0].tolist()
    errors = [] if status[:2] == [5, 1] and status[3] == 1 and status[2] < 1 else [f"timeout status {status}"]
    if seconds > 0.5:
        errors.append(f"the timed-out exchange took {seconds:.3f} s")
    return errors, seconds


def time_calls(ep: int, n: int = 200) -> float:
    ranks = Ranks(ep, 8192, 8)
    for r in range(ep):
        ranks.pack(r, 8192, r)
    for _ in range(10):
        ranks.launch()
    torch.cuda.synchronize(DEVICE)
    times = []
    for _ in range(n):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        ranks.launch()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1000)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rng = random.Random(0)
    result: dict = {"device": torch.cuda.get_device_name(DEVICE)}
    errors = []
    for ep in (1, 2, 3, 4):
        found = check_calls(ep, rng)
        result[f"calls_ep{ep}"] = "ok" if not found else found[:10]
        errors += found
    found, seconds = check_timeout()
    result["timeout"] = {"errors": found, "seconds": seconds}
    errors += found
    result["median_us_T8192_k8"] = {ep: time_calls(ep) for ep in (1, 2)}
    result["errors"] = errors
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
