"""`weave-moe tune`: measure the grouped GEMMs' candidate configurations per layer shape on this GPU and write the
tuned table that `gemm_configs.default_config` looks up (kernels/tuned/<device key>.json).

Work per (model, tokens): the per-rank work of EP = N (`--emulate-ep N`, as `weave-moe bench --emulate-ep`): E / N
local experts, T tokens each picking k distinct local experts uniformly at random (weave_moe.routing.uniform; with
`--routing uniform,skewed` also with the skewed routing, a candidate's time then the geomean over both), so T * k rows
grouped by expert; both GEMMs of the layer: GEMM0 + SiLU-mul (a [P, H] x interleaved w13 -> h [P, I]) and GEMM1 (h x
w2 -> y [P, H]), timed apart.

Per candidate: one run checked against an fp32 reference of the same bf16 inputs on up to 16 experts spread over the
range (relative Frobenius error <= weave_moe.reference.DEFAULT_TOLERANCE; outputs poisoned with NaN first and every
row checked for NaN), then the launch captured in a CUDA graph, 3 warm-up replays and the median of --reps replays
timed by CUDA events. A candidate that does not compile or launch (e.g. out of shared memory) is reported and skipped.

Kernels: the candidates are Triton grouped-GEMM configs (the grid options) and, where the layer runs them (an sm_90
GPU, KernelConfig.ws_gemm on: --ws auto, the default, takes their rule's configs; --ws names others), the
warp-specialised Gluon kernels' configs (kernels/ws_gemm.py, kernels/ws_decode.py), timed alike; not for a GEMM0
whose Gluon kernel would need the gather launch's copy where the Triton one reads the gather rows itself
(`gemm_configs.gluon_gemm0_copies`: KernelConfig.gemm0_gather without ws_gather). The default a candidate must beat is
what the layer runs without an entry (`gemm_configs.untuned_config`: there the Gluon kernels' rule where it has a
config, else the analytical config), always one of the candidates.

Table entries: for each shape and GEMM, the fastest candidate that passed, keyed by (gemm, E_local, H, I,
rows_bucket(T * k)), with its "kernel" and the "kernels" its candidates ran, written only where it beats the default
by at least --min-gain; elsewhere the shape is recorded under "measured_default" and the default keeps deciding.
Entries of an existing --out for shapes not measured in this run are kept (--replace starts a new table).

Exit status: 0 when every shape was measured; 1 when a shape failed; 2 when refused before starting (no GPU, not
Hopper or newer, an unknown model, an unusable --out).
"""

from __future__ import annotations

# No percent sign in any help text: argparse %-formats them.
HELP = ("measure the grouped GEMMs' tile configurations per layer shape on this GPU and write the tuned table that "
        "the weave backend looks up (one GPU)")

PAPER_TOKENS = "2048,8192"
#: Hopper's largest shared memory per block (227 KiB), used to skip candidates up front when no GPU says otherwise.
HOPPER_SMEM_BYTES = 232448
#: Accumulator registers per thread above which a tile spills (255 registers per thread in all).
MAX_ACC_REGS = 128
#: Cold-L2 timing: each timed replay reads at least this many times the L2's bytes of distinct weights.
COLD_L2_FACTOR = 4


def add_arguments(parser) -> None:
    parser.add_argument("--models", default=None,
                        help="comma-separated registry names (default: the six paper models; see `weave-moe models`)")
    parser.add_argument("--emulate-ep", type=int, default=1, metavar="N",
                        help="tune the per-rank work of EP=N: E/N local experts, T*k rows (default 1: all experts)")
    parser.add_argument("--tokens", default=PAPER_TOKENS, help="tokens per rank T, comma-separated (rows = T*k)")
    parser.add_argument("--block-m", default="64,128", help="candidate block_m values")
    parser.add_argument("--block-n", default="128,256", help="candidate block_n values (GEMM0: gate-up columns)")
    parser.add_argument("--block-k", default="64", help="candidate block_k values")
    parser.add_argument("--warps", default="4,8", help="candidate num_warps values")
    parser.add_argument("--stages", default="3,4,5", help="candidate num_stages values")
    parser.add_argument("--epilogue", default="", help="candidate epilogue values (0 masked stores, 2 clipped TMA, "
                        "3 clipped TMA in column halves; default: the analytical default's)")
    parser.add_argument("--group-m", default="", help="candidate group_m values (M tiles that sweep the N tiles "
                        "together; default: the analytical default's); given, each prefill-form --ws candidate is "
                        "also measured with each of them")
    parser.add_argument("--flatten", default="", help="candidate flatten values (1: the tile loop and the K loop "
                        "pipelined as one; default: the analytical default's)")
    parser.add_argument("--split-tail", default="0", help="candidate split_tail values (1: tails of at most "
                        "block_m / 2 rows as half-height tiles; measured a few percent faster on some large shapes, up "
                        "to 30%% slower where most experts end in a small tail)")
    parser.add_argument("--stream-k", default="0", help="candidate stream_k values (1: every CTA an equal range of "
                        "the tiles' K steps, for launches with few tiles such as decode)")
    parser.add_argument("--ws", default="auto", help="warp-specialised Gluon candidates too: comma-separated "
                        "compact names (e.g. 64x256x64w4s4, 128x256x64w8s4t, 64x256x64w4s4c2; decode form "
                        "t16w64k128s8), 'rule' for every config of the Gluon kernels' own rule, 'none'; default "
                        "'auto': 'rule' and the 192-row tiles (ws_gemm.ROW_PART_CONFIGS) where the layer runs the "
                        "Gluon kernels (an sm_90 GPU, KernelConfig.ws_gemm on), else none")
    parser.add_argument("--gemms", default="0,1", help="which GEMMs to tune: 0 (GEMM0 + SiLU-mul) and/or 1")
    parser.add_argument("--reps", type=int, default=20, help="timed CUDA-graph replays per candidate (median)")
    parser.add_argument("--min-gain", type=float, default=0.05,
                        help="write an entry only where the best candidate is at least this fraction faster than the "
                             "analytical default (run-to-run noise of one config is a few points)")
    parser.add_argument("--pairs", type=int, default=0, metavar="N",
                        help="then time GEMM0 -> GEMM1 back to back in one graph (as a call runs them, GEMM1 reading "
                             "GEMM0's h) for the N fastest configs of each alone (N x N pairs and the default pair), "
                             "and write the fastest pair's configs (default 0: each GEMM's fastest alone)")
    parser.add_argument("--confirm", type=int, default=3, metavar="ROUNDS",
                        help="then re-time the analytical default and the 3 fastest candidates of each GEMM in ROUNDS "
                             "rounds of alternating order (A B C D, D C B A, ...) and decide by the median over the "
                             "rounds: one pass times each candidate once, in one GPU state (a candidate timed right "
                             "after seconds of compiling runs at the higher clocks of an idle GPU); 0: one pass only")
    parser.add_argument("--routing", default="uniform",
                        help="routings each candidate is timed on, comma-separated: uniform, skewed (busiest expert "
                             "--skew x the mean); with several, a candidate's time is the geomean over them, so an "
                             "entry holds where one routing alone would overfit (a rows bucket's entry serves every "
                             "routing of that size)")
    parser.add_argument("--skew", type=float, default=3.0, help="busiest / mean expert rows of --routing skewed")
    parser.add_argument("--seed", type=int, default=0, help="routing and data seed")
    parser.add_argument("--warm-l2", action="store_true",
                        help="time every launch on the same experts, so weights that fit in the L2 cache stay there "
                             "between replays (default: cold, see `cold_rotations`: in a model's call the other "
                             "layers' weights pass through L2 between two calls of a layer)")
    parser.add_argument("--out", default=None,
                        help="table file (.json) or directory (the file is <device key>.json in it); default: the "
                             "package's table of this device (kernels/tuned/<device key>.json)")
    parser.add_argument("--replace", action="store_true",
                        help="write a new table instead of updating the measured shapes' entries of an existing --out")
    parser.add_argument("--list", action="store_true",
                        help="print the shapes and the candidate configurations, then stop (no GPU needed)")
    parser.add_argument("--git-commit", default=None,
                        help="commit to record when the tree here is not a git checkout (e.g. a copy on a GPU box)")


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated integers, given {text!r}") from None
    if not values or min(values) < 0:
        raise ValueError(f"{name}: expected comma-separated non-negative integers, given {text!r}")
    return values


def _optional_ints(text: str, name: str) -> list[int]:
    """`_ints`, or [] for an empty option (a field the candidates take from the analytical default)."""
    return _ints(text, name) if text.strip() else []


def config_name(config) -> str:
    """A short name of a GemmConfig, e.g. "128x256x64 w8 s4 e2" (tile, warps, stages, epilogue); a Gluon config's
    own (e.g. "ws 64x256x64 w4 s4 p40 r248")."""
    from weave_moe.backends.weave.kernels import gemm_configs as gc

    if not isinstance(config, gc.GemmConfig):
        return str(config)
    name = f"{config.block_m}x{config.block_n}x{config.block_k} w{config.num_warps} s{config.num_stages} " \
           f"e{config.epilogue}"
    if config.group_m != 8:
        name += f" g{config.group_m}"
    if not config.flatten:
        name += " noflat"
    if config.split_tail:
        name += " tail"
    if config.stream_k:
        name += " sk"
    return name


def candidate_configs(gemm: int, block_m, block_n, block_k, warps, stages, split_tail=(0,), epilogue=(), flatten=(),
                      group_m=(), stream_k=(0,), smem_bytes: int = HOPPER_SMEM_BYTES):
    """(candidates, skipped) for `gemm`: every combination as a variant of the analytical 128-row default (its
    epilogue, flatten and group_m unless `epilogue` / `flatten` / `group_m` list some), plus the analytical defaults;
    skipped = [(config, reason)] for combinations that cannot work: an accumulator over MAX_ACC_REGS fp32 registers
    per thread (spills), pipeline buffers over `smem_bytes`, or a config `gemm_configs.check_config` refuses."""
    import itertools

    from weave_moe.backends.weave.kernels import gemm_configs as gc

    base = gc.analytical_configs(gemm)[1]
    candidates, skipped = list(gc.analytical_configs(gemm)), []
    epilogues, flattens = tuple(epilogue) or (base.epilogue,), tuple(flatten) or (int(base.flatten),)
    groups = tuple(group_m) or (base.group_m,)
    streams = tuple(stream_k)
    for bm, bn, bk, nw, ns, tail, ep, flat, group, sk in itertools.product(
            block_m, block_n, block_k, warps, stages, split_tail, epilogues, flattens, groups, streams):
        # stream-K tiles store through masked stores (gemm_configs.check_config)
        config = base.with_(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, split_tail=bool(tail),
                            epilogue=gc.EPILOGUE_MASKED if sk else ep, flatten=bool(flat), group_m=group,
                            stream_k=bool(sk))
        if config in candidates:
            continue
        try:
            gc.check_config(gemm, config)
        except ValueError as error:
            skipped.append((config, str(error)))
            continue
        acc_regs = bm * bn // (32 * nw)
        buffers = ns * (bm + bn) * bk * 2
        if acc_regs > MAX_ACC_REGS:
            skipped.append((config, f"accumulator needs {acc_regs} fp32 registers per thread (> {MAX_ACC_REGS})"))
        elif buffers > smem_bytes:
            skipped.append((config, f"pipeline buffers need {buffers} bytes of shared memory (> {smem_bytes})"))
        else:
            candidates.append(config)
    return candidates, skipped


def ws_candidates(text: str, layer_ws: bool) -> list:
    """The --ws candidates: [] for "" or "none", every config of the Gluon kernels' rule for "rule", those and the
    192-row tiles (`ws_gemm.ROW_PART_CONFIGS`: no rule picks them, a table may) for "auto" where the layer runs them
    (`layer_ws`), else the compact names (`gemm_configs.parse_ws_config`; "rule" may be one of them); ValueError
    naming a bad name, or Gluon candidates for a layer that does not run them."""
    from weave_moe.backends.weave.kernels import gemm_configs as gc
    from weave_moe.backends.weave.kernels import ws_decode, ws_gemm

    text = text.strip()
    if text in ("", "none") or (text == "auto" and not layer_ws):
        return []
    if not layer_ws:
        raise ValueError(f"--ws {text}: the layer would not run the Gluon kernels here (they need an sm_90 GPU "
                         f"and KernelConfig.ws_gemm on)")
    configs = []
    for name in (part.strip() for part in text.split(",")):
        if name in ("rule", "auto"):
            configs += ws_gemm.default_configs() + ws_decode.default_configs()
            configs += ws_gemm.ROW_PART_CONFIGS if name == "auto" else ()
        elif name:
            configs.append(gc.parse_ws_config(name))
    return list(dict.fromkeys(configs))


def with_group_m(configs: list, groups) -> list:
    """The --ws candidates and, for each of the prefill form (`ws_gemm.WsConfig`), the same with each group_m of
    `groups` (--group-m; the decode form has no group order)."""
    import dataclasses

    from weave_moe.backends.weave.kernels import ws_gemm

    out = list(configs)
    for config in configs:
        if isinstance(config, ws_gemm.WsConfig):
            out += [dataclasses.replace(config, group_m=group) for group in groups]
    return list(dict.fromkeys(out))


def shape_candidates(candidates: list, default, gathered: bool) -> list:
    """One shape's candidates of a GEMM: the Triton and --ws candidates (no Gluon one for a GEMM0 whose Gluon kernel
    would need the gather launch's copy: `gathered`, gemm_configs.gluon_gemm0_copies), and the shape's `default` if
    not among them."""
    from weave_moe.backends.weave.kernels import gemm_configs as gc

    chosen = [c for c in candidates if isinstance(c, gc.GemmConfig) or not gathered]
    return chosen if default in chosen else chosen + [default]


#: the routings `--routing` names
ROUTINGS = ("uniform", "skewed")


def tune_routings(text: str, skew: float) -> tuple[str, ...]:
    """The routings of `--routing` (ROUTINGS, in the order given, without repeats); ValueError naming the text for
    an unknown one, none, or a skew below 1 where skewed routing is asked for."""
    routings = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [r for r in routings if r not in ROUTINGS]
    if not routings or unknown:
        raise ValueError(f"--routing: expected comma-separated names of {', '.join(ROUTINGS)}, given {text!r}")
    if "skewed" in routings and not skew >= 1.0:
        raise ValueError(f"--skew: expected a number >= 1 (busiest / mean expert rows), given {skew}")
    return routings


def tune_shapes(specs, tokens: list[int], emulate_ep: int) -> list[dict]:
    """[{"model", "tokens", "E_local", "k", "H", "I", "rows", "rows_bucket"}] of every (model, tokens)."""
    from weave_moe.backends.weave.kernels.gemm_configs import rows_bucket
    from weave_moe.bench.config import emulated_spec

    shapes = []
    for spec in specs:
        local = emulated_spec(spec, emulate_ep)
        for t in tokens:
            rows = t * local.top_k
            shapes.append(dict(model=spec.name, tokens=t, E_local=local.num_experts, k=local.top_k,
                               H=local.hidden_size, I=local.intermediate_size, rows=rows, rows_bucket=rows_bucket(rows)))
    return shapes


def run(args) -> int:
    import sys

    from weave_moe.backends.weave.kernels import gemm_configs as gc
    from weave_moe.models import PAPER_MODELS, MoESpec

    def refuse(message: str) -> int:
        print(f"weave-moe tune: {message}", file=sys.stderr)
        return 2

    try:
        names = [n.strip() for n in args.models.split(",") if n.strip()] if args.models else list(PAPER_MODELS)
        specs = [MoESpec.from_name(name) for name in names]
        tokens = _ints(args.tokens, "--tokens")
        if min(tokens) < 1:
            raise ValueError(f"--tokens: every count must be >= 1, given {args.tokens!r}")
        gemms = _ints(args.gemms, "--gemms")
        if set(gemms) - {0, 1}:
            raise ValueError(f"--gemms: expected 0 and/or 1, given {args.gemms!r}")
        grid = dict(block_m=_ints(args.block_m, "--block-m"), block_n=_ints(args.block_n, "--block-n"),
                    block_k=_ints(args.block_k, "--block-k"), warps=_ints(args.warps, "--warps"),
                    stages=_ints(args.stages, "--stages"), split_tail=_ints(args.split_tail, "--split-tail"),
                    epilogue=_optional_ints(args.epilogue, "--epilogue"),
                    flatten=_optional_ints(args.flatten, "--flatten"),
                    group_m=_optional_ints(args.group_m, "--group-m"),
                    stream_k=_ints(args.stream_k, "--stream-k"))
        if set(grid["split_tail"]) - {0, 1}:
            raise ValueError(f"--split-tail: expected 0 and/or 1, given {args.split_tail!r}")
        if set(grid["epilogue"]) - set(gc.EPILOGUES):
            raise ValueError(f"--epilogue: expected values of {gc.EPILOGUES}, given {args.epilogue!r}")
        if set(grid["stream_k"]) - {0, 1}:
            raise ValueError(f"--stream-k: expected 0 and/or 1, given {args.stream_k!r}")
        if set(grid["flatten"]) - {0, 1}:
            raise ValueError(f"--flatten: expected 0 and/or 1, given {args.flatten!r}")
        if any(group < 1 for group in grid["group_m"]):
            raise ValueError(f"--group-m: expected ints >= 1, given {args.group_m!r}")
        if args.emulate_ep < 1:
            raise ValueError(f"--emulate-ep: expected an int >= 1, given {args.emulate_ep}")
        if args.reps < 1:
            raise ValueError(f"--reps: expected an int >= 1, given {args.reps}")
        if args.confirm < 0:
            raise ValueError(f"--confirm: expected an int >= 0, given {args.confirm}")
        if args.pairs < 0 or (args.pairs and sorted(set(gemms)) != [0, 1]):
            raise ValueError(f"--pairs: expected an int >= 0, and both GEMMs (--gemms 0,1), given --pairs "
                             f"{args.pairs} --gemms {args.gemms}")
        routings = tune_routings(args.routing, args.skew)
        shapes = tune_shapes(specs, tokens, args.emulate_ep)
    except (KeyError, ValueError) as error:
        return refuse(str(error).strip("'\""))

    import torch

    from weave_moe.backends.weave.config import KernelConfig

    # the layer runs the Gluon kernels on an sm_90 GPU with KernelConfig.ws_gemm on (weave backend); --list assumes
    # one without a GPU
    cuda = torch.cuda.is_available()
    layer_ws = KernelConfig.from_env().ws_gemm and (torch.cuda.get_device_capability()[0] == 9 if cuda else args.list)
    if args.list or cuda:
        try:
            ws = with_group_m(ws_candidates(args.ws, layer_ws), grid["group_m"])
        except ValueError as error:
            return refuse(str(error))
    if args.list:
        _print_plan(shapes, gemms, grid, ws, routings)
        return 0
    if not cuda:
        return refuse("needs a CUDA GPU (torch.cuda.is_available() is False): the table holds times measured on "
                      "the device it is for. Without a GPU the analytical defaults apply; --list shows what would "
                      "be measured.")
    capability = torch.cuda.get_device_capability()
    if capability < (9, 0):
        return refuse(f"needs Hopper or newer (sm_90+: TMA and wgmma); this GPU is sm_{capability[0]}{capability[1]}")
    try:
        out = _out_path(args.out)
        table = _start_table(out, args.replace, device_key=gc.device_key(torch.cuda.get_device_name()))
    except ValueError as error:
        return refuse(str(error))
    return _tune(args, specs, shapes, gemms, grid, ws, layer_ws, out, table, routings)


def _print_plan(shapes, gemms, grid, ws=(), routings=("uniform", )) -> None:
    print(f"{len(shapes)} shapes (model, T: E_local x H x I, rows -> bucket), timed on {', '.join(routings)} "
          f"routing{'s (geomean)' if len(routings) > 1 else ''}:")
    for s in shapes:
        print(f"  {s['model']}, T={s['tokens']}: {s['E_local']} x {s['H']} x {s['I']}, {s['rows']} rows -> "
              f"{s['rows_bucket']}")
    for gemm in gemms:
        candidates, skipped = candidate_configs(gemm, **grid)
        print(f"GEMM{gemm}: {len(candidates)} candidates: {', '.join(config_name(c) for c in candidates)}")
        for config, reason in skipped:
            print(f"  skipped {config_name(config)}: {reason}")
    if ws:
        print(f"warp-specialised candidates (both GEMMs; not a gathered GEMM0): "
              f"{', '.join(config_name(c) for c in ws)}")


def _out_path(out):
    from pathlib import Path

    import torch

    from weave_moe.backends.weave.kernels import gemm_configs as gc

    name = f"{gc.device_key(torch.cuda.get_device_name())}.json"
    if out is None:
        return gc.TUNED_DIR / name
    path = Path(out)
    return path if path.suffix == ".json" else path / name


def _start_table(out, replace: bool, device_key: str) -> dict:
    """The table to update: the existing `out` (checked) unless `replace` or absent, else an empty one.
    ValueError before anything is measured when `out` is not a table, or holds configs measured on another device
    than this GPU (`device_key`, `gemm_configs.device_key`): an H100's times written into the H200's table would be
    read on every H200."""
    import json

    from weave_moe.backends.weave.kernels import gemm_configs as gc

    if out.exists() and not replace:
        gc.load_tuned_table(out)  # ValueError naming the file when it is not a table: refuse before measuring
        gc.clear_tuned_cache()
        table = json.loads(out.read_text())
        held = table.get("device_key")   # absent until a run has written the table
        if held is not None and held != device_key:
            raise ValueError(f"{out} holds configs measured on {table.get('device', held)} ({held}), and this GPU is "
                             f"{device_key}: a table serves the device it was measured on (give --out another file, "
                             "or --replace to start it anew for this GPU)")
        return table
    return dict(format=gc.TUNED_FORMAT, entries=[], measured_default=[])


def _write_table(out, table: dict) -> None:
    import json
    import os

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    os.replace(tmp, out)


class _Work:
    """One shape's tensors on the GPU: inputs, weights, outputs, the fp32 reference on the checked experts.

    `l2_bytes` (None: warm timing) sets `rotations[gemm]` (`cold_rotations` of the weights one launch of that GEMM
    reads); rotation r's launches run on `rotated_counts` (its own tile tables; only rotation 0 is checked).
    Where the layer's GEMM0 of a config reads its rows through the gather rows (`gemm_configs.reads_gather_rows`
    under WEAVE_MOE_KERNEL_CONFIG: gemm0_gather for the Triton kernel, ws_gather for the Gluon one), that config's
    GEMM0 is timed so: its rows scattered over a source buffer in a random order. The
    launches use programmatic dependent launch where the layer's do (KernelConfig.grouped_pdl)."""

    def __init__(self, shape: dict, seed: int, l2_bytes: int | None = None, routing_name: str = "uniform",
                 skew: float = 3.0):
        import torch
        import torch.nn.functional as F

        from weave_moe import routing
        from weave_moe.backends.weave.config import KernelConfig
        from weave_moe.backends.weave.kernels import grouped_gemm as gg
        from weave_moe.reference import _ieee_fp32_matmul

        E, H, I = shape["E_local"], shape["H"], shape["I"]
        if routing_name == "skewed":
            ids, _ = routing.skewed(shape["tokens"], E, shape["k"], skew=skew, seed=seed)
        else:
            ids, _ = routing.uniform(shape["tokens"], E, shape["k"], seed=seed)
        counts = torch.bincount(ids.long().flatten(), minlength=E)
        self.rows = int(counts.sum())
        active = int((counts > 0).sum())
        self.rotations = {g: 1 if l2_bytes is None else cold_rotations(active * per_expert * 2, l2_bytes, E)
                          for g, per_expert in ((0, 2 * I * H), (1, H * I))}
        most = max(self.rotations.values())
        self.rotated_offsets = []   # rotation 0 = the unrotated counts, the ones checked
        for r in range(most):
            offsets = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
            offsets[1:] = torch.cumsum(rotated_counts(counts, r, most), 0).cuda()
            self.rotated_offsets.append(offsets)
        self.offsets = self.rotated_offsets[0]
        self.alloc = (self.rows + 127) // 128 * 128  # the backend's buffers are sized by a bound, not the count
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.a = torch.randn(self.alloc, H, device="cuda", generator=gen).bfloat16()
        w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) / H ** 0.5).bfloat16()
        self.w2 = (torch.randn(E, H, I, device="cuda", generator=gen) / I ** 0.5).bfloat16()
        offs = self.offsets.tolist()
        checked = sorted(set(torch.linspace(0, E - 1, min(16, E)).round().long().tolist()))
        checked = [e for e in checked if offs[e + 1] > offs[e]]
        self.check_rows = torch.cat([torch.arange(offs[e], offs[e + 1], device="cuda") for e in checked])
        self.h_ref = torch.empty(len(self.check_rows), I, device="cuda")
        self.y_ref = torch.empty(len(self.check_rows), H, device="cuda")
        # GEMM1's input: the reference h (rounded to bf16) on the checked rows, random elsewhere
        self.h_in = (torch.randn(self.alloc, I, device="cuda", generator=gen) / 4).bfloat16()
        at = 0
        with _ieee_fp32_matmul():
            for e in checked:
                s, f = offs[e], offs[e + 1]
                gate_up = self.a[s:f].float() @ w13[e].float().T
                h = F.silu(gate_up[:, :I]) * gate_up[:, I:]
                self.h_ref[at:at + f - s] = h
                self.h_in[s:f] = h.bfloat16()
                self.y_ref[at:at + f - s] = self.h_in[s:f].float() @ self.w2[e].float().T
                at += f - s
        self.w13 = gg.interleave_w13(w13)
        del w13
        self.gather = self.source = None
        self.kernel_config = kernel_config = KernelConfig.from_env()
        self.inter = I
        self.pdl = kernel_config.grouped_pdl   # launched as the layer launches them
        if kernel_config.gathers_in_gemm0(I) or kernel_config.ws_gather:   # source[gather[m]] = a[m]
            self.gather = torch.randperm(self.alloc, device="cuda", generator=gen).int()
            self.source = torch.empty_like(self.a)
            self.source[self.gather.long()] = self.a
        self.h = torch.empty(self.alloc, I, device="cuda", dtype=torch.bfloat16)
        self.y = torch.empty(self.alloc, H, device="cuda", dtype=torch.bfloat16)
        self.tables: dict = {}
        self.stream_k_scratch = gg.StreamKScratch("cuda")   # made once per size, as the layer does
        self.status = torch.zeros(4, dtype=torch.int32, device="cuda")   # a stream-K wait's timeout would land here

    def table(self, block_m: int, split_tail: bool = False, rotation: int = 0):
        from weave_moe.backends.weave.kernels import grouped_gemm as gg

        key = (block_m, split_tail, rotation)
        if key not in self.tables:
            self.tables[key] = gg.build_tile_table(self.rotated_offsets[rotation], block_m, self.alloc, split_tail)
        return self.tables[key]

    def launcher(self, gemm: int, config, rotation: int = 0, after_gemm0: bool = False):
        """One launch of `gemm` with `config` on rotation `rotation`'s rows; `after_gemm0`: GEMM1 reads GEMM0's
        output `h` (a pair, as in a call) instead of the checked input `h_in`."""
        from weave_moe.backends.weave.kernels import gemm_configs as gc
        from weave_moe.backends.weave.kernels import grouped_gemm as gg

        tiles = self.table(config.block_m, config.split_tail, rotation)
        # a stream-K config's scratch made once per size, not inside each timed graph (the Gluon kernels take none)
        launch = dict(pdl=self.pdl, stream_k_scratch=self.stream_k_scratch, status=self.status)
        if gemm == 0 and self.gather is not None and gc.reads_gather_rows(config, self.kernel_config, self.inter):
            return lambda: gg.launch_gemm(0, config, self.source, self.w13, self.h, tiles, gather=self.gather,
                                          **launch)
        if gemm == 0:
            return lambda: gg.launch_gemm(0, config, self.a, self.w13, self.h, tiles, **launch)
        h = self.h if after_gemm0 else self.h_in
        return lambda: gg.launch_gemm(1, config, h, self.w2, self.y, tiles, **launch)

    def error(self, gemm: int, launch) -> float:
        """Relative Frobenius error of one poisoned run on the checked rows (inf when any row holds NaN)."""
        import torch

        from weave_moe.reference import moe_error

        out, ref = (self.h, self.h_ref) if gemm == 0 else (self.y, self.y_ref)
        out.fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        if torch.isnan(out[:self.rows]).any() or self.status.any():   # unwritten rows, or a stream-K wait timed out
            return float("inf")
        return moe_error(out[self.check_rows], ref)[0]


#: Candidates re-timed by the confirmation rounds besides the analytical default: the fastest of the first pass.
CONFIRM_TOP = 3


def confirm_order(configs: list, rounds: int) -> list:
    """The order of the confirmation rounds: `configs` forwards, then backwards, and so on, so that a drift of the
    GPU's clocks over the rounds falls on every config alike."""
    return [config for r in range(rounds) for config in (configs if r % 2 == 0 else configs[::-1])]


def confirm_measured(measured: list, default, rounds: int, time_ms) -> list:
    """The analytical `default` and the CONFIRM_TOP fastest of `measured` [(ms, config, err)] re-timed by
    `time_ms(config)` in `rounds` rounds of `confirm_order`: [(median ms over the rounds, config, err)], fastest
    first. Only these are returned: the others' single times are not comparable with them."""
    import statistics

    ranked = sorted(measured, key=lambda m: m[0])
    chosen = [m[1] for m in ranked[:CONFIRM_TOP]]
    if default not in chosen and any(config == default for _, config, _ in measured):
        chosen.append(default)
    samples = {config: [] for config in chosen}
    for config in confirm_order(chosen, rounds):
        samples[config].append(time_ms(config))
    errors = {config: err for _, config, err in measured}
    return sorted(((statistics.median(samples[c]), c, errors[c]) for c in chosen), key=lambda m: m[0])


def cold_rotations(launch_bytes: int, l2_bytes: int, num_experts: int) -> int:
    """How many launches a cold-L2 timing rotates through: the smallest R with R * `launch_bytes` (the weights one
    launch reads) >= COLD_L2_FACTOR * `l2_bytes`, at most `num_experts` (rotation r moves every expert's rows r * E/R
    experts on, so R rotations read mostly different expert sets), at least 1 (a launch that reads that much already
    evicts its own weights)."""
    if launch_bytes <= 0:
        return 1
    return max(1, min(num_experts, -(-COLD_L2_FACTOR * l2_bytes // launch_bytes)))


def rotated_counts(counts, rotation: int, rotations: int):
    """Per-expert row counts of rotation `rotation` of `rotations`: `counts` rolled by rotation * (E // rotations)
    experts (the same rows, the same tile shapes, other experts' weights)."""
    import torch

    return torch.roll(counts, rotation * (len(counts) // max(rotations, 1)))


def _tune(args, specs, shapes, gemms, grid, ws, layer_ws, out, table, routings=("uniform", )) -> int:
    import datetime
    import shlex
    import statistics
    import sys
    import time
    import traceback

    import torch
    import triton

    from weave_moe.backends.weave.config import KernelConfig
    from weave_moe.backends.weave.kernels import gemm_configs as gc
    from weave_moe.backends.weave.kernels import sync
    from weave_moe.bench.anchor import graph_replay_ms
    from weave_moe.bench.report import geomean
    from weave_moe.bench.metadata import git_commit
    from weave_moe.reference import DEFAULT_TOLERANCE

    device = torch.cuda.get_device_name()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    # the opt-in shared memory per block, as Triton's own compiler checks it
    smem = triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())["max_shared_mem"]
    candidates = {g: candidate_configs(g, **grid, smem_bytes=smem) for g in gemms}
    candidates = {g: (triton + ws, skipped) for g, (triton, skipped) in candidates.items()}
    table.update(format=gc.TUNED_FORMAT, device=device, device_key=gc.device_key(device), meta=dict(
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        sms=props.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
        commit=args.git_commit or git_commit(), command=shlex.join(["weave-moe", "tune"] + sys.argv[2:]
                                                                   if sys.argv[1:2] == ["tune"] else sys.argv),
        emulate_ep=args.emulate_ep, models=[s.name for s in specs], tokens=sorted({s["tokens"] for s in shapes}),
        reps=args.reps, min_gain=args.min_gain, tolerance=DEFAULT_TOLERANCE, confirm_rounds=args.confirm,
        routing=list(routings), skew=args.skew if "skewed" in routings else None,
        candidates={f"gemm{g}": [config_name(c) for c in candidates[g][0]] for g in gemms},
        timing=("median of CUDA-event-timed CUDA-graph replays (3 warm-ups), one launch per replay" if args.warm_l2
                else "median of CUDA-event-timed CUDA-graph replays (3 warm-ups); a replay runs `rotations` launches "
                     "on rotated expert sets (cold_rotations: >= COLD_L2_FACTOR x L2 of distinct weights), time per "
                     "launch = replay / rotations"),
        l2_bytes=props.L2_cache_size, cold_l2_factor=None if args.warm_l2 else COLD_L2_FACTOR,
        # whether the GEMMs were launched with programmatic dependent launch (as the layer launches them)
        pdl=sync.launch_options(KernelConfig.from_env().grouped_pdl)["launch_pdl"]))
    table.setdefault("measured_default", [])
    print(f"tuning on {device} ({props.multi_processor_count} SMs), {len(shapes)} shapes, "
          f"{', '.join(f'GEMM{g}: {len(candidates[g][0])} candidates' for g in gemms)}; writing {out}", flush=True)
    for g in gemms:
        for config, reason in candidates[g][1]:
            print(f"  GEMM{g} skipped {config_name(config)}: {reason}")

    def times_alone(works, gemm, config) -> list[float]:
        """ms of one launch of `config` alone on each routing's work: the median of --reps replays, each over the
        cold rotations. A candidate's time is the geomean over the routings."""
        def one(work):
            launches = [work.launcher(gemm, config, r) for r in range(work.rotations[gemm])]
            return statistics.median(graph_replay_ms(lambda: [launch() for launch in launches],
                                                     args.reps)) / len(launches)
        return [one(work) for work in works]

    results, failed, started = [], 0, time.time()
    for shape in shapes:
        print(f"{shape['model']} T={shape['tokens']}: {shape['E_local']} x {shape['H']} x {shape['I']}, "
              f"{shape['rows']} rows (elapsed {time.time() - started:.0f} s)", flush=True)
        try:
            works = [_Work(shape, args.seed, None if args.warm_l2 else props.L2_cache_size, name, args.skew)
                     for name in routings]
            work = works[0]
        except Exception:
            traceback.print_exc()
            failed += 1
            continue
        alone, counts, kernels = {}, {}, {}
        for gemm in gemms:
            gathers = work.kernel_config.gemm0_gathers(shape["I"])
            default = gc.untuned_config(gemm, work.rows, shape["E_local"], warp_specialized=layer_ws,
                                        gathers=gathers)
            measured = []
            copies = gemm == 0 and gc.gluon_gemm0_copies(gathers)   # no Gluon GEMM0 candidate then
            shape_configs = shape_candidates(candidates[gemm][0], default, copies)
            kernels[gemm] = sorted({gc.kernel_of(c) for c in shape_configs}, key=list(gc.KERNELS).index)
            for config in shape_configs:
                name = config_name(config)
                try:
                    err = max(w.error(gemm, w.launcher(gemm, config)) for w in works)
                    if not err <= DEFAULT_TOLERANCE:
                        print(f"  GEMM{gemm} {name}: WRONG, error {err:.2e} > {DEFAULT_TOLERANCE:g}", flush=True)
                        continue
                    if not measured:   # a shape's first timing of a GEMM can run slow throughout (an H100,
                        times_alone(works, gemm, config)   # bench/results/h100-1eee06e): timed twice, the second kept
                    each = times_alone(works, gemm, config)
                    ms = geomean(each)
                except Exception as error:  # a config that does not compile or launch must not stop the sweep
                    print(f"  GEMM{gemm} {name}: FAILED {type(error).__name__}: {str(error)[:200]}", flush=True)
                    torch.cuda.synchronize()
                    continue
                measured.append((ms, config, err))
                # with several routings each one's time too: a config that wins on one alone shows here
                split = f" ({', '.join(f'{r} {t:.4f}' for r, t in zip(routings, each))})" if len(each) > 1 else ""
                print(f"  GEMM{gemm} {name}: {ms:.4f} ms{split}, error {err:.1e}"
                      f"{'  (default)' if config == default else ''}", flush=True)
            counts[gemm] = len(measured)
            if args.confirm and measured:
                measured = confirm_measured(measured, default, args.confirm,
                                            lambda config, gemm=gemm, works=works: geomean(
                                                times_alone(works, gemm, config)))
                for ms, config, _ in measured:
                    print(f"  GEMM{gemm} {config_name(config)}: {ms:.4f} ms over {args.confirm} rounds "
                          f"(confirmed)", flush=True)
            alone[gemm] = (default, measured)
        chosen = {}
        if args.pairs and all(alone.get(g, (None, []))[1] for g in (0, 1)):
            try:
                chosen = _tune_pairs(works, alone, args.pairs, args.reps)
            except Exception as error:  # the GEMMs alone still stand
                print(f"  pairs: FAILED {type(error).__name__}: {str(error)[:200]}", flush=True)
                torch.cuda.synchronize()
        for gemm, (default, measured) in alone.items():
            result = _record(table, shape, gemm, default, measured, args.min_gain, args.emulate_ep,
                             work.rotations[gemm], pair=chosen.get(gemm),
                             gathered=gemm == 0 and work.gather is not None, candidates=counts[gemm],
                             kernels=kernels[gemm])
            if result is not None:
                result.pop("run")
            if result is None:
                failed += 1
                print(f"  GEMM{gemm}: no candidate passed", flush=True)
                continue
            results.append(result)
            _write_table(out, table)
        del work, works
        torch.cuda.empty_cache()
    table["entries"].sort(key=lambda e: tuple(e[k] for k in ("gemm", "E_local", "H", "I", "rows_bucket")))
    table["measured_default"].sort(key=lambda e: tuple(e[k] for k in ("gemm", "E_local", "H", "I", "rows_bucket")))
    _write_table(out, table)
    gc.clear_tuned_cache()
    _print_results(results, out)
    print(f"wrote {out}: {len(table['entries'])} entries ({sum(r['written'] for r in results)} from this run), "
          f"{time.time() - started:.0f} s")
    return 1 if failed else 0


def _tune_pairs(works, alone: dict, top: int, reps: int) -> dict:
    """Time GEMM0 -> GEMM1 pairs back to back (GEMM1 reading GEMM0's h) in one graph, on the cold rotations of both:
    the `top` fastest configs of each GEMM alone, crossed, and the analytical default pair; `pair_choice` of them.
    `works`: one per routing, a pair's time the geomean over them."""
    import statistics

    from weave_moe.bench.anchor import graph_replay_ms
    from weave_moe.bench.report import geomean

    def one(work, first, second):
        rotations = len(work.rotated_offsets)
        launches = [launch for r in range(rotations)
                    for launch in (work.launcher(0, first, r), work.launcher(1, second, r, after_gemm0=True))]
        return statistics.median(graph_replay_ms(lambda: [launch() for launch in launches], reps)) / rotations

    def pair_ms(first, second):
        return geomean([one(work, first, second) for work in works])

    fastest = {g: [config for _, config, _ in sorted(alone[g][1], key=lambda m: m[0])[:top]] for g in (0, 1)}
    timed = {}
    for first in fastest[0]:
        for second in fastest[1]:
            timed[first, second] = pair_ms(first, second)
            print(f"  pair {config_name(first)} -> {config_name(second)}: {timed[first, second]:.4f} ms", flush=True)
    default = (alone[0][0], alone[1][0])
    default_ms = timed[default] if default in timed else pair_ms(*default)
    print(f"  pair (default) {config_name(default[0])} -> {config_name(default[1])}: {default_ms:.4f} ms", flush=True)
    return pair_choice(timed, default_ms)


def pair_choice(timed: dict, default_ms: float) -> dict:
    """The fastest of the timed pairs {(GEMM0 config, GEMM1 config): ms}: {gemm: {"config", "pair_ms",
    "pair_default_ms", "pair", "pairs_measured"}} for GEMM0 and GEMM1 (what `_record` writes with `pair=`)."""
    (first, second), best_ms = min(timed.items(), key=lambda item: item[1])
    info = dict(pair_ms=best_ms, pair_default_ms=default_ms, pair=[config_name(first), config_name(second)],
                pairs_measured=len(timed))
    return {0: dict(info, config=first), 1: dict(info, config=second)}


def _record(table, shape, gemm, default, measured, min_gain, emulate_ep, rotations: int = 1,
            pair: dict | None = None, gathered: bool = False, candidates: int | None = None,
            kernels: list | None = None) -> dict | None:
    """Put one measured (shape, gemm) into the table (replacing older records of its key); a result row for the
    printout, or None when no candidate passed. `pair` (`pair_choice`): write the fastest pair's config of this
    GEMM, by the pair's gain over the default pair, instead of this GEMM's fastest alone. `gathered`: GEMM0 was
    timed reading its rows through gather rows (recorded). `candidates`: how many passed the first pass when
    `measured` holds only the confirmed ones (default: len(measured)). `kernels`: the kernels the candidates ran
    (gemm_configs.KERNELS names; default ["triton"]), recorded: an entry measured against the Gluon kernels decides
    over their rule."""
    import dataclasses

    from weave_moe.backends.weave.kernels import gemm_configs as gc

    if not measured:
        return None
    best_ms, best, best_err = min(measured, key=lambda m: m[0])
    default_ms = next((ms for ms, config, _ in measured if config == default), None)
    gain = default_ms / best_ms - 1 if default_ms else float("inf")
    if pair is not None:
        best = pair["config"]
        best_ms, best_err = next((ms, err) for ms, config, err in measured if config == best)
        gain = pair["pair_default_ms"] / pair["pair_ms"] - 1
    written = best != default and gain >= min_gain
    key = dict(gemm=gemm, E_local=shape["E_local"], H=shape["H"], I=shape["I"], rows_bucket=shape["rows_bucket"])
    meta = table["meta"]
    record = dict(key, model=shape["model"], tokens=shape["tokens"], emulate_ep=emulate_ep, rows=shape["rows"],
                  ms=round(best_ms, 5), default_ms=None if default_ms is None else round(default_ms, 5),
                  default=config_name(default), best=config_name(best), error=float(f"{best_err:.3g}"),
                  candidates_measured=len(measured) if candidates is None else candidates, rotations=rotations,
                  kernels=list(kernels or ["triton"]), run=f"{meta['date']} {meta['commit']}")
    if gathered:
        record.update(gathered=True)
    if pair is not None:
        record.update(pair_ms=round(pair["pair_ms"], 5), pair_default_ms=round(pair["pair_default_ms"], 5),
                      pair=pair["pair"], pairs_measured=pair["pairs_measured"])
    for section in ("entries", "measured_default"):
        table[section] = [e for e in table[section] if any(e.get(k) != v for k, v in key.items())]
    if written:
        table["entries"].append(dict(record, kernel=gc.kernel_of(best), config=dataclasses.asdict(best)))
    else:
        table["measured_default"].append(record)
    return dict(record, gain=gain, written=written)


def _print_results(results, out) -> None:
    from rich.table import Table

    from weave_moe.commands import print_table

    table = Table(title=f"best candidate vs analytical default per shape (median ms; written to {out} where "
                        f"'table' says yes)")
    for column in ("model", "T", "GEMM", "E_local x H x I", "rows -> bucket", "default", "ms", "best", "ms",
                   "speedup", "table"):
        table.add_column(column, justify="left" if column in ("model", "default", "best", "table") else "right",
                         no_wrap=True)
    for r in results:
        default_ms = "failed" if r["default_ms"] is None else f"{r['default_ms']:.4f}"
        speedup = "-" if r["default_ms"] is None else f"{r['default_ms'] / r['ms']:.3f}x"
        table.add_row(r["model"], str(r["tokens"]), str(r["gemm"]), f"{r['E_local']} x {r['H']} x {r['I']}",
                      f"{r['rows']} -> {r['rows_bucket']}", r["default"], default_ms, r["best"], f"{r['ms']:.4f}",
                      speedup, "yes" if r["written"] else "no")
    print_table(table)
