"""The task tables as Triton kernels (kernels/tables.py and its stages) against `layout.build_layout`, bit for bit on every entry the
megakernel reads, under the interpreter; and the three kernels compile for sm_90 without local memory.

Cases: 1-4 ranks, empty ranks, one token, chunk counts 1-8 per rank, -1 holes, a token repeating an expert (within
the static bound: k <= E_local), every token on one expert, more tokens than one scan block, production tile sizes.
"""

from interpreter import run_interpreted

SCRIPT = r'''
import sys, torch
from weave_moe.backends.weave.exchange import RoutingMessage
from weave_moe.backends.weave.layout import build_layout, META_FIELDS
from weave_moe.backends.weave.kernels.tables import build_layout_triton, counter_words

def case(tokens, E, k, chunks, rank, seed, mode="uniform", T_max=None, blocks=None, block_tokens=None,
         counters=None, emit_tokens=None, previous_writes="any", serial_c=None, buffers=None):
    P = len(tokens); T = T_max or max(max(tokens), 1) + 2
    g = torch.Generator().manual_seed(seed)
    msg = RoutingMessage(T, k)
    rows = []
    for s, n in enumerate(tokens):
        if mode == "uniform":
            ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)]).int() if n else torch.zeros(0, k, dtype=torch.int32)
        elif mode == "dups":
            ids = torch.randint(-1, E, (n, k), generator=g, dtype=torch.int32)
        else:  # one expert
            ids = torch.full((n, k), E - 1, dtype=torch.int32)
        w = torch.rand(n, k, generator=g)
        out = torch.empty(msg.words, dtype=torch.int32)
        msg.pack(out, ids, w, msg.pad(), torch.arange(T + 1, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))
        rows.append(out)
    allr = torch.stack(rows)
    ids, wts, toks = msg.unpack(allr)
    plans = torch.zeros(P, 4, dtype=torch.int32); plans[:, 1] = torch.tensor(chunks)
    b = blocks or dict(block_m=4, block_n0=8, block_n1=8, dispatch_rows=2, combine_rows=3, reduce_rows=2)
    kw = dict(hidden_size=20, intermediate_size=12, **b)
    ref = build_layout(ids, wts, toks, plans[:, 1], rank, E, **kw)
    # serial_c: this rank's c of a layer that runs serial plans (c >= 4 SMs here) through the grouped GEMMs
    serial = {} if serial_c is None else dict(serial_plan=torch.tensor([serial_c], dtype=torch.int32), num_sms=4)
    got = build_layout_triton(ids, wts, toks, plans[:, 1], rank, E, block_tokens=block_tokens, counters=counters,
                              emit_tokens=emit_tokens, previous_writes=previous_writes, buffers=buffers, **serial,
                              **kw)
    if counters is not None:   # the caller's counters are zero again for its next call
        assert not counters.any(), counters
    meta = ref.meta.tolist()
    assert got.meta.tolist() == meta, ("meta", got.meta.tolist(), meta)
    nd, ng, nc, nr, nm = meta
    def eq(name, a, b):
        assert torch.equal(a, b), (name, a, b)
    eq("dispatch", got.dispatch_tasks[:nd], ref.dispatch_tasks[:nd])
    nsend = int(ref.combine_expected.sum())
    eq("send_token", got.send_token[:nsend], ref.send_token[:nsend])
    eq("send_slot", got.send_slot[:nsend], ref.send_slot[:nsend])
    npairs = int((ids >= rank * (E // P)).logical_and(ids < (rank + 1) * (E // P)).sum())
    eq("gather", got.gather_rows[:npairs], ref.gather_rows[:npairs])
    if serial_c is None or serial_c < 4:   # under a serial plan the GEMM task rows are not written
        eq("gemm", got.gemm_tasks[:ng], ref.gemm_tasks[:ng])
    eq("arrival", got.arrival_expected, ref.arrival_expected)
    eq("gemm1_expected", got.gemm1_expected, ref.gemm1_expected)
    eq("combine_tasks", got.combine_tasks[:nc], ref.combine_tasks[:nc])
    # one row per task (a decode call's tables): task j is row j, one row each; the megakernel's decode launches
    # rely on it (they load task j's row data before its task row arrives: megakernel.py, ONE_ROW_TASKS)
    for rows, tasks, n in ((b["dispatch_rows"], got.dispatch_tasks, nd), (b["combine_rows"], got.combine_tasks, nc)):
        if rows == 1:
            eq("one-row starts", tasks[:n, 2], torch.arange(n, dtype=torch.int32))
            eq("one-row counts", tasks[:n, 3], torch.ones(n, dtype=torch.int32))
    nrecv = int(ref.arrival_expected.sum())
    eq("combine_token", got.combine_token[:nrecv], ref.combine_token[:nrecv])
    eq("combine_pos", got.combine_pos[:nrecv], ref.combine_pos[:nrecv])
    eq("combine_weight", got.combine_weight[:nrecv], ref.combine_weight[:nrecv])
    eq("mask", got.token_dest_mask, ref.token_dest_mask)
    eq("combine_expected", got.combine_expected, ref.combine_expected)
    eq("expert_offsets", got.expert_offsets, ref.expert_offsets)
    assert got.num_mtiles_bound == ref.num_mtiles_bound and got.max_pairs == ref.max_pairs
    assert tuple(got.gemm_tasks.shape) == tuple(ref.gemm_tasks.shape), (got.gemm_tasks.shape, ref.gemm_tasks.shape)
    for name in ("dispatch_tasks", "send_token", "send_slot", "gather_rows", "combine_tasks", "combine_token", "combine_pos", "combine_weight"):
        assert getattr(got, name).shape == getattr(ref, name).shape, name
    return meta

cases = [((7, 5), 8, 2, (1, 1), 0), ((7, 5), 8, 2, (2, 3), 1), ((9, 4), 8, 3, (8, 1), 0), ((0, 6), 8, 2, (1, 2), 0),
         ((0, 6), 8, 2, (1, 2), 1), ((1, 1), 4, 2, (4, 4), 1), ((13,), 8, 3, (3,), 0), ((4, 7, 0, 5), 8, 2, (1, 2, 3, 4), 2),
         ((8, 8), 4, 4, (2, 2), 1), ((30, 17, 22), 12, 4, (4, 8, 2), 1)]
for i, c in enumerate(cases):
    for mode in ("uniform", "dups", "one") if c[2] <= c[1] // len(c[0]) else ("uniform",):
        case(*c, seed=i, mode=mode, previous_writes=("any", "none", "chunks")[i % 3])
print("TABLES OK")
prod = dict(block_m=128, block_n0=128, block_n1=256, dispatch_rows=16, combine_rows=16, reduce_rows=16)
case((300, 280), 16, 4, (3, 5), 0, seed=11, blocks=dict(block_m=16, block_n0=8, block_n1=8, dispatch_rows=16, combine_rows=16, reduce_rows=16))
case((300, 280), 16, 4, (3, 5), 1, seed=12, mode="dups", blocks=prod)
case((600,), 64, 8, (2,), 0, seed=13, blocks=prod)
case((600,), 64, 8, (1,), 0, seed=14, T_max=700, blocks=prod)
# a few tokens in a large T_max (most programs find no token), no token at all
case((1, 3), 16, 4, (1, 2), 1, seed=20, T_max=2100, blocks=prod)
case((0, 0), 16, 4, (1, 1), 0, seed=21, T_max=300, blocks=prod)
# many scan blocks (8 tokens each, steps of 8 or 4 tokens), chunk boundaries inside steps, 1-3 ranks
case((600,), 64, 8, (8,), 0, seed=15, blocks=prod, block_tokens=8)
case((70, 0, 53), 12, 4, (3, 8, 5), 2, seed=16, mode="dups", block_tokens=8)
case((70, 41), 16, 16, (7, 2), 1, seed=17, mode="dups", block_tokens=8)
# the scan's pairs per (expert, chunk) in its second pass, after the wait for the chunk counts (early_scan)
case((600,), 64, 8, (8,), 0, seed=15, blocks=prod, block_tokens=8, previous_writes="chunks")
case((70, 0, 53), 12, 4, (3, 8, 5), 2, seed=16, mode="dups", block_tokens=8, previous_writes="chunks")
case((300, 280), 16, 4, (3, 5), 1, seed=24, blocks=prod, serial_c=3, previous_writes="chunks")
case((70, 41), 16, 16, (7, 2), 1, seed=17, mode="dups", block_tokens=8, emit_tokens=16)   # many emit programs
case((600,), 64, 8, (3,), 0, seed=22, blocks=prod, emit_tokens=32)
# a layer that runs serial plans through the grouped GEMMs: every other table under a serial plan, all under another
case((300, 280), 16, 4, (1, 1), 0, seed=23, blocks=prod, serial_c=4)
case((300, 280), 16, 4, (3, 5), 1, seed=24, blocks=prod, serial_c=3)
# a decode call's tables (KernelConfig.decode_stages): one row per dispatch, combine and reduce task
decode = dict(prod, dispatch_rows=1, combine_rows=1, reduce_rows=1)
case((5, 3), 16, 4, (1, 1), 0, seed=18, blocks=decode)
case((60, 0, 7), 12, 4, (3, 8, 5), 1, seed=19, mode="dups", blocks=decode)
case((0, 9, 4, 1), 16, 4, (1, 1, 2, 1), 2, seed=25, mode="dups", blocks=decode, previous_writes="none")
case((1,), 8, 2, (1,), 0, seed=26, blocks=decode)
# a caller's persistent counters (the resident call's), reused by calls of other routings, ranks and chunk counts
counters = torch.zeros(counter_words(2, 16), dtype=torch.int32)
for seed, (tokens, chunks, rank) in enumerate([((7, 5), (1, 2), 0), ((30, 2), (3, 1), 1), ((0, 9), (8, 8), 0)]):
    case(tokens, 16, 4, chunks, rank, seed=30 + seed, mode="dups", counters=counters,
         previous_writes=("any", "chunks")[seed % 2])
# one TableBuffers rewritten by calls of other routings, ranks, chunk counts and waits (a layer's resident calls at
# every row count): each call's tables are the torch tables, whatever an earlier call left past its counts
from weave_moe.backends.weave.kernels.tables import TableBuffers
buffers = TableBuffers.for_layer(2, 40, 4, 16, hidden_size=20, intermediate_size=12, block_m=4, block_n0=8,
                                 block_n1=8, dispatch_rows=2, combine_rows=3, device="cpu")
for seed, (tokens, chunks, rank, mode) in enumerate([((40, 37), (8, 3), 0, "dups"), ((1, 0), (1, 1), 1, "uniform"),
                                                     ((33, 40), (2, 5), 1, "one"), ((0, 0), (1, 1), 0, "uniform"),
                                                     ((12, 5), (4, 8), 0, "dups")]):
    case(tokens, 16, 4, chunks, rank, seed=60 + seed, mode=mode, T_max=40, buffers=buffers,
         previous_writes=("any", "chunks", "none")[seed % 3])
try:   # buffers of other shapes are refused
    case((5, 5), 16, 4, (1, 1), 0, seed=70, T_max=41, buffers=buffers)
    raise AssertionError("buffers of T_max 40 accepted for T_max 41")
except ValueError as error:
    assert "buffers are for" in str(error), error
# ids outside [-1, E) as the independent scan can see them (the counts kernel beside it replaces them by -1 in
# place, maybe after the scan read them): they count as -1; 3 ranks, so an id >= E would name "rank 3" of BLOCK_P = 4
P, T, k, E = 3, 9, 2, 12
msg = RoutingMessage(T, k)
g = torch.Generator().manual_seed(40)
rows, clean = [], []
for s in range(P):
    ids = torch.randint(0, E, (T - 2, k), generator=g, dtype=torch.int32)
    bad = ids.clone(); bad[0, 0] = E + 2; bad[1, 1] = -5; bad[2, 0] = 2 * E
    ok = bad.clone(); ok[(bad < -1) | (bad >= E)] = -1
    w = torch.rand(T - 2, k, generator=g)
    for target, source in ((rows, bad), (clean, ok)):
        out = torch.empty(msg.words, dtype=torch.int32)
        msg.pack(out, source, w, msg.pad(), torch.arange(T + 1, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))
        target.append(out)
plans = torch.zeros(P, 4, dtype=torch.int32); plans[:, 1] = torch.tensor([2, 1, 3])
kw = dict(hidden_size=20, intermediate_size=12, block_m=4, block_n0=8, block_n1=8, dispatch_rows=2, combine_rows=3,
          reduce_rows=2)
ref = build_layout(*msg.unpack(torch.stack(clean)), plans[:, 1], 1, E, **kw)
for previous_writes in ("none", "chunks"):   # the early scan reads them before the planning counts launch ends
    got = build_layout_triton(*msg.unpack(torch.stack(rows)), plans[:, 1], 1, E, previous_writes=previous_writes,
                              **kw)
    assert got.meta.tolist() == ref.meta.tolist(), (got.meta.tolist(), ref.meta.tolist())
    assert torch.equal(got.token_dest_mask, ref.token_dest_mask)
    assert torch.equal(got.combine_expected, ref.combine_expected)
    assert torch.equal(got.arrival_expected, ref.arrival_expected)
print("TABLES BIG OK")
'''


def test_triton_tables_equal_the_torch_tables_under_the_interpreter():
    run_interpreted(SCRIPT, "TABLES BIG OK", timeout=900)   # printed after every other case passed


def test_triton_tables_compile_for_sm90_without_local_memory():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from weave_moe.backends.weave.kernels import tables_bases, tables_emit, tables_scan

    def signature(fn, constants, fp32=()):
        return {name: "constexpr" if name in constants else ("*fp32" if name in fp32 else "*i32")
                if name.endswith("_ptr") else "i32" for name in fn.arg_names}

    for fn, constants, fp32 in [
        (tables_scan.scan_kernel, dict(L=128, K=8, KP=8, MC=8, BT=64, SUB=16, BLOCK_L=128, BLOCK_P=2,
                                   WAIT=tables_scan.WAIT_FIRST.value), ()),
        (tables_scan.scan_kernel, dict(L=128, K=8, KP=8, MC=8, BT=64, SUB=16, BLOCK_L=128, BLOCK_P=4,
                                   WAIT=tables_scan.WAIT_LAST.value), ()),
        (tables_scan.scan_kernel, dict(L=128, K=8, KP=8, MC=8, BT=64, SUB=16, BLOCK_L=128, BLOCK_P=2,
                                   WAIT=tables_scan.WAIT_BEFORE_CHUNKS.value), ()),
        (tables_bases.bases_kernel, dict(L=128, MC=8, BLOCK_L=128, BLOCK_P=2, BLOCK_PMC=16, BLOCK_B=64, BLOCK_C=64,
                                    CLEAR_COUNTS=True), ()),
        (tables_emit.emit_kernel, dict(L=128, K=8, KP=8, MC=8, BLOCK_T=256, BT=64, BLOCK_P=2, BLOCK_PMC=16,
                                   BLOCK_SEG=1024, BLOCK_J=64, BLOCK_N=16, SERIAL_GROUPED=False),
         ("weights_ptr", "combine_weight_ptr")),
        (tables_emit.emit_kernel, dict(L=128, K=8, KP=8, MC=8, BLOCK_T=256, BT=64, BLOCK_P=2, BLOCK_PMC=16,
                                   BLOCK_SEG=1024, BLOCK_J=64, BLOCK_N=64, SERIAL_GROUPED=True),
         ("weights_ptr", "combine_weight_ptr")),
    ]:
        source = ASTSource(fn=fn, signature=signature(fn, constants, fp32), constexprs=constants)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        assert ".local" not in ptx, fn.__name__


def _loads_before_waits(ptx: str) -> list[int]:
    """For each `griddepcontrol.wait` of a PTX listing: the global loads before it in its basic block."""
    counts, loads = [], 0
    for line in ptx.splitlines():
        if line.startswith("$L__BB"):   # a branch target: another basic block
            loads = 0
        elif "griddepcontrol.wait" in line:
            counts.append(loads)
        elif "ld.global" in line:
            loads += 1
    return counts


def test_emit_loads_what_earlier_launches_wrote_before_its_wait():
    """The emit kernel (sync.pdl_ahead) issues its loads of the ids, weights, chunk counts and the scan's ranks before
    it waits for the bases kernel, in the sm_90 PTX: the received-tokens path and the sent-tokens path each load
    ahead of their wait; the task rows, which read only what the bases kernel wrote, wait first."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from weave_moe.backends.weave.kernels import tables_emit

    fn = tables_emit.emit_kernel
    constants = dict(L=64, K=8, KP=8, MC=8, BLOCK_T=32, BT=64, BLOCK_P=2, BLOCK_PMC=16, BLOCK_SEG=512, BLOCK_J=64,
                     BLOCK_N=16, SERIAL_GROUPED=True)
    signature = {name: "constexpr" if name in constants else
                 ("*fp32" if name in ("weights_ptr", "combine_weight_ptr") else "*i32") if name.endswith("_ptr")
                 else "i32" for name in fn.arg_names}
    ptx = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                         target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    received, sent, tasks = _loads_before_waits(ptx)
    # received: T_s (twice: valid, the chunk), ids, the chunk count, q, the token's rank, weights; sent: T, ids,
    # the token's rank
    assert received >= 6 and sent >= 3 and tasks == 0, (received, sent, tasks)


def test_rank_is_never_specialised_in_a_launched_kernel():
    """Triton compiles an int argument equal to 1 as a constant unless it is in `do_not_specialize`. A kernel whose
    `rank` is specialised runs another binary on rank 1 than on rank 0 (compiled while the peers already wait in the
    call's exchange) and may not compile at all: the scan kernel failed with CompilationError on rank 1 (`rank.to(...)`
    on a constant), so the device-resident call at EP = 2 raised on rank 1 while rank 0 waited out its deadline for
    rank 1's rows. Every kernel the package launches with a `rank` argument keeps it a runtime value."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import weave_moe

    launched = []
    for info in pkgutil.walk_packages(weave_moe.__path__, "weave_moe."):
        if info.name in ("weave_moe.hf",):
            continue  # optional extra (transformers); it launches no kernel
        module = importlib.import_module(info.name)
        for name, fn in vars(module).items():
            if isinstance(fn, JITFunction) and fn.__module__ == module.__name__ and name.endswith("kernel"):
                params = {p.name: p for p in fn.params}
                if "rank" in params:
                    launched.append(name)
                    assert params["rank"].do_not_specialize, f"{info.name}.{name}: rank is specialised"
    assert {"scan_kernel", "bases_kernel", "emit_kernel", "counts_kernel", "moe_megakernel",
            "routing_exchange_kernel"} <= set(launched)

