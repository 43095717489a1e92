"""Configurations of the grouped GEMMs (kernels/grouped_gemm.py): `GemmConfig`, its checks, the analytical
defaults and the tuned tables that `weave-moe tune` writes.

Configurations: `default_config` looks the layer shape and rows bucket up in the current device's tuned table
(kernels/tuned/<device key>.json, written by `weave-moe tune`; $WEAVE_MOE_TUNED_TABLE overrides it) and otherwise
falls back to the analytical rule (`analytical_config`); `default_configs` lists every configuration it can return
for a layer shape, which a caller that must not compile mid-call compiles first.

Kernels. A configuration names its kernel by its type (`KERNELS`): a GemmConfig runs the Triton grouped GEMMs
(kernels/grouped_gemm.py), a `ws_gemm.WsConfig` / `ws_decode.WsDecodeConfig` the warp-specialised Gluon ones. A
caller that may run the latter (`warp_specialized`: an sm_90 GPU and KernelConfig.ws_gemm) gets, in this order: a
table entry measured against warp-specialised candidates (whichever kernel won), else the Gluon kernels' own rule
where it has a config (`ws_rule`), else a Triton entry, else the analytical config. Any other caller never gets a
Gluon config: a table's warp-specialised entry then leaves the shape to the analytical rule.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from weave_moe.backends.weave.kernels import ws_decode, ws_gemm

__all__ = ["GemmConfig", "default_config", "default_configs", "analytical_config", "analytical_configs", "ws_rule",
           "reads_gather_rows", "gluon_gemm0_copies",
           "untuned_config", "check_ws_config", "KERNELS", "kernel_of", "parse_ws_config",
           "tuned_config", "tuned_table_path", "load_tuned_table", "clear_tuned_cache", "check_config",
           "config_from_fields", "device_key", "rows_bucket", "TUNED_TABLE_ENV", "TUNED_DIR", "TUNED_FORMAT",
           "EPILOGUE_MASKED", "EPILOGUE_TMA", "EPILOGUE_TMA_CLIPPED", "EPILOGUE_TMA_HALVES", "CLIPPED_EPILOGUES",
           "EPILOGUES"]

# Epilogue kinds (GemmConfig.epilogue).
EPILOGUE_MASKED = 0  # every tile through masked pointer stores
EPILOGUE_TMA = 1     # full tiles through TMA, tail tiles through masked stores
EPILOGUE_TMA_CLIPPED = 2  # every tile through TMA, from a descriptor made on the device that ends at the expert's
#                           last row (needs triton.set_allocator for the descriptors' global scratch)
EPILOGUE_TMA_HALVES = 3   # as EPILOGUE_TMA_CLIPPED, in two column halves through one half-size shared buffer: half
#                           the epilogue's shared memory (GEMM1 at 128x256 keeps 4 stages: 229 KB against 262 KB)
CLIPPED_EPILOGUES = (EPILOGUE_TMA_CLIPPED, EPILOGUE_TMA_HALVES)
#: Every GemmConfig.epilogue value.
EPILOGUES = (EPILOGUE_MASKED, EPILOGUE_TMA, *CLIPPED_EPILOGUES)


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and schedule of one grouped GEMM launch.

    Attributes:
        block_m: rows per M tile (64 or 128).
        block_n: accumulator columns per tile; for GEMM0 with `interleaved`, BN/2 gate-up pairs (BN/2 columns of h).
        block_k: K step.
        group_m: M tiles that sweep the N tiles together (L2 reuse of weight blocks).
        num_stages: software pipeline depth (shared-memory stages).
        num_warps: 4 (one warpgroup) or 8 (two).
        epilogue: EPILOGUE_MASKED, EPILOGUE_TMA, EPILOGUE_TMA_CLIPPED or EPILOGUE_TMA_HALVES.
        warp_specialize: 0 none, 1 on the persistent tile loop, 2 on the K loop.
        flatten: flatten the tile loop and the K loop into one pipelined loop (the next tile's loads overlap the
            epilogue).
        interleaved: GEMM0 only: one wide MMA over interleaved w13 (True) or two MMAs, gate and up (False, w13 as
            given).
        split_tail: tails of at most block_m / 2 rows run as half-height tiles after the full ones (TileTable).
        stream_k: every CTA takes an equal range of the flat (tile, K step) order instead of whole tiles (module
            docstring, "Stream-K"), for launches with fewer tiles than SMs or a poor last wave (decode). With
            masked stores (epilogue 0); GEMM0 with the interleaved w13 only.
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8
    epilogue: int = EPILOGUE_TMA
    warp_specialize: int = 0
    flatten: bool = True
    interleaved: bool = True
    split_tail: bool = False
    stream_k: bool = False

    def with_(self, **changes) -> "GemmConfig":
        return replace(self, **changes)


#: The kernel of each configuration type, as a tuned table's entries name it ("kernel"; absent: "triton").
KERNELS = {"triton": GemmConfig, "ws": ws_gemm.WsConfig, "ws_decode": ws_decode.WsDecodeConfig}


def kernel_of(config) -> str:
    """The `KERNELS` name of a configuration's type; TypeError for anything else."""
    for name, kind in KERNELS.items():
        if isinstance(config, kind):
            return name
    raise TypeError(f"not a grouped-GEMM configuration of any kernel ({', '.join(KERNELS)}): {config!r}")


def parse_ws_config(text: str):
    """A warp-specialised config from its compact name: "t16w64k128s8" (`ws_decode.WsDecodeConfig.parse`) or
    "64x256x64w4s4" (`ws_gemm.WsConfig.parse`); ValueError naming the text otherwise."""
    text = text.strip()
    config = (ws_decode.WsDecodeConfig if text.startswith("t") else ws_gemm.WsConfig).parse(text)
    check_ws_config(config)
    return config


def reads_gather_rows(config, kernel_config, inter: int) -> bool:
    """Whether a layer's GEMM0 of `config` reads the received rows through the gather rows instead of after the
    gather launch's copy (under KernelConfig `kernel_config`, intermediate size `inter`): a GemmConfig where
    `kernel_config.gathers_in_gemm0(inter)`, a ws_gemm.WsConfig that `gathers` where `kernel_config.ws_gather`, the
    decode form never."""
    kernel = kernel_of(config)
    return kernel in kernel_config.gemm0_gathers(inter) and (kernel != "ws" or config.gathers)


def gluon_gemm0_copies(gathers: tuple) -> bool:
    """Whether the Gluon GEMM0 would need the gather launch's copy where the Triton one reads the gather rows itself:
    `gathers` (KernelConfig.gemm0_gathers: the KERNELS whose GEMM0 reads them) holds "triton" and not "ws"."""
    return "triton" in gathers and "ws" not in gathers


def ws_rule(gemm: int, rows: int, num_local_experts: int, gathers: tuple = ()):
    """The warp-specialised kernels' own rule (no table): the decode form under ws_gemm.MIN_ROWS_PER_EXPERT rows per
    expert (`ws_decode.default_config`), else `ws_gemm.default_config` (None where it keeps the Triton kernels).
    `gathers`: the kernels whose GEMM0 reads the received rows through the gather rows in the caller's layer
    (KernelConfig.gemm0_gathers). Where the Triton GEMM0 does and the Gluon one does not (`gluon_gemm0_copies`),
    None for GEMM0 at prefill sizes: the Gluon GEMM0 would need the gather launch's copy first (Qwen3-30B-A3B at
    8192 tokens 1.301 against 1.234 ms in calls on an H100, bench/results/h100-a9c802a)."""
    if rows < ws_gemm.MIN_ROWS_PER_EXPERT * num_local_experts:
        return ws_decode.default_config(rows, num_local_experts)
    if gemm == 0 and gluon_gemm0_copies(gathers):
        return None
    return ws_gemm.default_config(gemm, rows, num_local_experts)


def default_config(gemm: int, rows: int, num_local_experts: int, hidden: int | None = None,
                   inter: int | None = None, *, table: str | os.PathLike | None = None,
                   warp_specialized: bool = False, gathers: tuple = ()):
    """The configuration of a GEMM of `rows` rows over `num_local_experts` experts of hidden size `hidden` and
    intermediate size `inter`; `gemm` is 0 or 1. Decided on the host, without the per-expert counts.

    First the tuned table (the current device's, measured by `weave-moe tune`) for this shape and rows bucket;
    without a table, an entry or the shape (`hidden` / `inter` None), the analytical default (`analytical_config`).
    With `warp_specialized` (the caller runs the Gluon kernels too) the order of the module docstring ("Kernels").
    Cheap enough to run per call: the table is parsed once and each lookup is cached.

    Args:
        table: a table file to use instead of the device's (see `tuned_table_path`).
        warp_specialized: the caller may run the warp-specialised kernels (else a GemmConfig always).
        gathers: the kernels whose GEMM0 reads its rows through gather rows in the caller's layer
            (KernelConfig.gemm0_gathers; `ws_rule`).
    """
    if gemm not in (0, 1):
        raise ValueError(f"gemm: expected 0 or 1, given {gemm!r}")
    entry = None
    if hidden is not None and inter is not None:
        path = _table_path(table)
        if path is not None:
            entry = _lookup(path, gemm, num_local_experts, hidden, inter, rows_bucket(rows))
    # a table made with another KernelConfig.gemm0_gather / ws_gather may hold a Gluon GEMM0 that would need the
    # gather launch's copy here
    if warp_specialized and entry is not None and entry.against_ws and not (
            gluon_gemm0_copies(gathers) and gemm == 0 and isinstance(entry.config, ws_gemm.WsConfig)):
        return entry.config
    untuned = untuned_config(gemm, rows, num_local_experts, warp_specialized=warp_specialized, gathers=gathers)
    if entry is not None and isinstance(entry.config, GemmConfig) and isinstance(untuned, GemmConfig):
        return entry.config   # a Triton entry measured without the Gluon kernels, where their rule has nothing
    return untuned


def untuned_config(gemm: int, rows: int, num_local_experts: int, *, warp_specialized: bool = False,
                   gathers: tuple = ()):
    """What `default_config` picks without a table entry: with `warp_specialized` the Gluon kernels' rule where it
    has a config (`ws_rule`), else the analytical config (what `weave-moe tune` measures its candidates against)."""
    rule = ws_rule(gemm, rows, num_local_experts, gathers) if warp_specialized else None
    return rule or analytical_config(gemm, rows, num_local_experts)


def default_configs(gemm: int, num_local_experts: int | None = None, hidden: int | None = None,
                    inter: int | None = None, *, table: str | os.PathLike | None = None,
                    warp_specialized: bool = False) -> tuple:
    """Every configuration `default_config` can pick for `gemm` (0 or 1) at this layer shape, whatever the caller's
    gather rows: the analytical ones (`analytical_configs`), with `warp_specialized` the Gluon kernels' rule's, then
    the tuned table's configs of the shape (every rows bucket; Gluon ones only with `warp_specialized`), without
    repeats. Without the shape, the
    analytical ones (and the rule's) only. A caller that must not compile during a call (the weave backend, before
    its first-call barrier) compiles these."""
    configs = analytical_configs(gemm)
    if warp_specialized:
        configs += ws_gemm.default_configs() + ws_decode.default_configs()
    if num_local_experts is None or hidden is None or inter is None:
        return configs
    path = _table_path(table)
    if path is None:
        return configs
    tuned = _load_table(path)["shapes"].get((gemm, num_local_experts, hidden, inter), {})
    entries = (tuned[bucket].config for bucket in sorted(tuned))
    return tuple(dict.fromkeys(configs + tuple(c for c in entries if warp_specialized or isinstance(c, GemmConfig))))


#: GEMM0 at decode sizes: at most this many rows per expert on average -> `analytical_configs(0)[2]` (16-row tiles)
DECODE_ROWS_PER_EXPERT = 8


@functools.lru_cache(maxsize=4096)
def analytical_config(gemm: int, rows: int, num_local_experts: int) -> GemmConfig:
    """The configuration measured best on one H200 (scripts/gemm_bench.py, bench/results/gemm/) before any per-shape
    tuning, for a GEMM of `rows` rows over `num_local_experts` experts.

    128x256 tiles (two warpgroups, 4 stages; GEMM0 stores through the clipped TMA epilogue) unless 64-row tiles
    would pad the average expert by over 25 points less: e.g. 154 rows per expert pad to 256 in 128-row tiles (66%)
    but to 192 in 64-row tiles (25%), and there one warpgroup with 64x256 tiles wins despite its lower MMA rate.
    GEMM0 with at most DECODE_ROWS_PER_EXPERT rows per expert (decode sizes): 16x128 tiles with BLOCK_K 128, one
    warpgroup, 4 stages, where each expert's tile is a few rows and the launch streams its weights: the winner of
    nearly every decode shape (1-64 tokens, six models) in the H100 tune and in the H200 table's decode entries, and
    in calls 26.2 -> 21.4 us for Qwen3-30B-A3B's GEMM0 at 1 token on an H100 (docs/perf-notes.md entry 42). GEMM1
    keeps the others: its tuned decode winners differ by shape, and one ran slower in a call than this default.
    Assumes balanced-ish experts (the average stands for each).
    """
    configs = analytical_configs(gemm)
    mean = max(rows / max(num_local_experts, 1), 1.0)
    if gemm == 0 and mean <= DECODE_ROWS_PER_EXPERT:
        return configs[2]
    narrow, wide = configs[:2]

    def padding(block_m):
        return -(-mean // block_m) * block_m / mean - 1

    return narrow if padding(128) - padding(64) > 0.25 else wide


def analytical_configs(gemm: int) -> tuple[GemmConfig, ...]:
    """Every configuration `analytical_config` can pick for `gemm` (0 or 1): (64-row tiles, 128-row tiles) and for
    GEMM0 the decode tiles (16 rows) third."""
    if gemm not in (0, 1):
        raise ValueError(f"gemm: expected 0 or 1, given {gemm!r}")
    epilogue = EPILOGUE_TMA_CLIPPED if gemm == 0 else EPILOGUE_MASKED
    configs = (GemmConfig(block_m=64, num_warps=4, num_stages=4 if gemm == 0 else 5, epilogue=epilogue),
               GemmConfig(block_m=128, num_warps=8, num_stages=4, epilogue=epilogue))
    if gemm == 0:
        configs += (GemmConfig(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=4, epilogue=epilogue),)
    return configs


# ---- tuned configurations ------------------------------------------------------------------------------------------
# One JSON file per device kind, kernels/tuned/<device key>.json, written by `weave-moe tune` (commands/tune.py):
#   {"format": TUNED_FORMAT, "device": "NVIDIA H200", "device_key": "nvidia-h200", "meta": {...},
#    "entries": [{"gemm": 0, "E_local": 64, "H": 2048, "I": 768, "rows_bucket": 16384,
#                 "config": {every GemmConfig field}, ...measurements...}, ...]}
# An entry may also hold "kernel" ("ws" / "ws_decode": "config" holds every WsConfig / WsDecodeConfig field; absent:
# "triton") and "kernels" (the kernels its candidates ran; absent: ["triton"]): an entry whose candidates included
# warp-specialised ones decides over `ws_rule` (module docstring, "Kernels").
# Only "format" and the entries' key, kernel, kernels and config fields are read here; everything else is a record of
# the run.

#: The table file to use instead of the device's: a path, or "off" / "none" for no table (the analytical defaults).
TUNED_TABLE_ENV = "WEAVE_MOE_TUNED_TABLE"
#: Where the shipped tables live (package data).
TUNED_DIR = Path(__file__).resolve().parent / "tuned"
TUNED_FORMAT = "weave-moe-tuned-gemm/1"
_ENTRY_KEYS = ("gemm", "E_local", "H", "I", "rows_bucket")


def device_key(device_name: str) -> str:
    """A device name as a file stem: "NVIDIA H200" -> "nvidia-h200" (lower case, runs of other characters -> "-")."""
    key = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    if not key:
        raise ValueError(f"device_key: no letters or digits in {device_name!r}")
    return key


def rows_bucket(rows: int) -> int:
    """The power of two nearest `rows` on a log scale (the bucket boundaries are 2^n * sqrt(2)); 1 for rows <= 1.

    Tuned points sit at T * k rows for power-of-two token counts, mostly at a bucket's centre, so the rows of real
    calls (which scatter around T * k) land in the bucket their T was tuned for.
    """
    if rows <= 1:
        return 1
    low = 1 << (int(rows).bit_length() - 1)
    return 2 * low if rows * rows >= 2 * low * low else low


def tuned_table_path(device: torch.device | int | None = None) -> Path | None:
    """The tuned table of `device` (default: the current CUDA device): TUNED_DIR / "<device_key(name)>.json"; None
    without CUDA. The file may not exist (no table for this device)."""
    if not _cuda_available():
        return None
    if isinstance(device, int):
        index = device
    elif device is not None and device.index is not None:
        index = device.index
    else:
        index = torch.cuda.current_device()
    return _device_table_path(index)


def tuned_config(gemm: int, rows: int, num_local_experts: int, hidden: int, inter: int, *,
                 table: str | os.PathLike | None = None):
    """The tuned configuration of this shape and `rows_bucket(rows)` (of any kernel), or None (no table, no entry).

    The table: `table` if given, else the file named by $WEAVE_MOE_TUNED_TABLE ("off" / "none": no table), else the
    current CUDA device's shipped table (`tuned_table_path`; none without CUDA). A table that exists but cannot be
    used raises ValueError naming the file; so does a missing file given by `table` or the variable.
    """
    if gemm not in (0, 1):
        raise ValueError(f"gemm: expected 0 or 1, given {gemm!r}")
    path = _table_path(table)
    if path is None:
        return None
    entry = _lookup(path, gemm, num_local_experts, hidden, inter, rows_bucket(rows))
    return None if entry is None else entry.config


def load_tuned_table(path: str | os.PathLike) -> dict:
    """The table at `path`, checked: {"shapes": {(gemm, E_local, H, I): {rows_bucket: TunedEntry}}, "data": the JSON}
    (cached per path: call `clear_tuned_cache` after changing a file). ValueError naming the file if it is not a
    table this version reads."""
    return _load_table(str(path))


def clear_tuned_cache() -> None:
    """Forget parsed tables and cached lookups (after a table file changed)."""
    for cache in (_load_table, _lookup, _explicit_path, _existing_device_table):
        cache.cache_clear()


def check_config(gemm: int, config: GemmConfig) -> None:
    """ValueError unless `config` is one the kernels compile and the weave backend can run for `gemm`."""
    def power_of_two(value, least):
        return isinstance(value, int) and value >= least and value & (value - 1) == 0

    problems = []
    for field, least in (("block_m", 16), ("block_n", 16), ("block_k", 16)):
        if not power_of_two(getattr(config, field), least):
            problems.append(f"{field}={getattr(config, field)!r} is not a power of two >= {least}")
    if config.num_warps not in (4, 8):
        problems.append(f"num_warps={config.num_warps!r} is not 4 or 8")
    if not (isinstance(config.num_stages, int) and config.num_stages >= 1):
        problems.append(f"num_stages={config.num_stages!r} is not an int >= 1")
    if not (isinstance(config.group_m, int) and config.group_m >= 1):
        problems.append(f"group_m={config.group_m!r} is not an int >= 1")
    if config.epilogue not in EPILOGUES:
        problems.append(f"epilogue={config.epilogue!r} is not one of {EPILOGUES}")
    elif config.epilogue == EPILOGUE_TMA_HALVES and config.block_n // (4 if gemm == 0 else 2) < 8:
        problems.append(f"epilogue=3 (TMA halves): a half of the output tile is block_n / {4 if gemm == 0 else 2} "
                        f"columns, under TMA's 16 bytes")
    elif config.epilogue == EPILOGUE_TMA and config.flatten:
        problems.append("epilogue=1 (TMA) with flatten does not compile in Triton 3.6")
    if config.warp_specialize not in (0, 1, 2):
        problems.append(f"warp_specialize={config.warp_specialize!r} is not 0, 1 or 2")
    if config.split_tail and config.epilogue == EPILOGUE_TMA:
        problems.append("split_tail with epilogue=1 (TMA): its one store descriptor is of full tiles")
    if gemm == 0 and not config.interleaved:
        problems.append("interleaved=False: a table's or the analytical configs are for the interleaved w13 (a "
                        "layer that keeps w13 as given derives its own from them, KernelConfig.interleave_w13)")
    if config.stream_k and (config.split_tail or config.warp_specialize or (gemm == 0 and not config.interleaved)):
        problems.append("stream_k: not with split_tail, warp_specialize or (GEMM0) interleaved=False")
    if config.stream_k and config.epilogue != EPILOGUE_MASKED:
        # the clipped TMA epilogue's device-made descriptor inside the stream-K loop spilled 4-8 bytes (sm_90)
        problems.append("stream_k: its tiles store through masked stores (epilogue=0)")
    if problems:
        raise ValueError(f"GEMM{gemm} config {config}: " + "; ".join(problems))


def config_from_fields(gemm: int, fields: dict, kernel: str = "triton"):
    """A configuration of `kernel` (a `KERNELS` name) from a table entry's "config" object (every field; unknown or
    missing ones are errors), checked (`check_config`; the Gluon configs check themselves)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {', '.join(KERNELS)}, given {kernel!r}")
    names = [f.name for f in dataclasses.fields(KERNELS[kernel])]
    if not isinstance(fields, dict):
        raise ValueError(f"config: expected an object with the fields {names}, given {fields!r}")
    unknown = sorted(set(fields) - set(names))
    missing = [name for name in names if name not in fields]
    if unknown or missing:
        raise ValueError(f"config: unknown fields {unknown}, missing fields {missing}")
    config = KERNELS[kernel](**fields)
    if kernel == "triton":
        check_config(gemm, config)
    else:
        check_ws_config(config)
    return config


def check_ws_config(config) -> None:
    """ValueError unless a warp-specialised `config` (its own checks passed when it was made) is one a layer can run:
    not on K-blocked weights (`WsConfig.k_blocked`: a probe's; a layer holds its weights as given)."""
    if config.k_blocked:
        raise ValueError(f"{config}: k_blocked (K-blocked weights) is a probe's layout, no layer holds its weights so")


@dataclass(frozen=True)
class TunedEntry:
    """One table entry as read: its configuration (of any kernel) and whether its candidates included the
    warp-specialised kernels (then it decides over `ws_rule`)."""

    config: object
    against_ws: bool


def _cuda_available() -> bool:
    global _CUDA
    if _CUDA is None:
        _CUDA = bool(torch.cuda.is_available())
    return _CUDA


_CUDA: bool | None = None


@functools.lru_cache(maxsize=None)
def _device_table_path(index: int) -> Path:
    return TUNED_DIR / f"{device_key(torch.cuda.get_device_name(index))}.json"


@functools.lru_cache(maxsize=None)
def _existing_device_table(index: int) -> str | None:
    path = _device_table_path(index)
    return str(path) if path.is_file() else None


def _table_path(table) -> str | None:
    """The table file of one lookup as a string (the caches' key), or None for no table."""
    if table is not None:
        return _explicit_path(str(table), "table")
    override = os.environ.get(TUNED_TABLE_ENV)
    if override:
        return None if override.lower() in ("off", "none") else _explicit_path(override, f"${TUNED_TABLE_ENV}")
    if not _cuda_available():
        return None
    return _existing_device_table(torch.cuda.current_device())


@functools.lru_cache(maxsize=64)
def _explicit_path(path: str, source: str) -> str:
    if not os.path.isfile(path):
        raise ValueError(f"{source}: no tuned GEMM table at {path}")
    return path


@functools.lru_cache(maxsize=16)
def _load_table(path: str) -> dict:
    def fail(what):
        raise ValueError(f"tuned GEMM table {path}: {what}")

    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        fail(f"cannot be read as JSON ({error})")
    if not isinstance(data, dict) or data.get("format") != TUNED_FORMAT:
        fail(f"expected a JSON object with \"format\": \"{TUNED_FORMAT}\", given "
             f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r}")
    entries = data.get("entries")
    if not isinstance(entries, list):
        fail("\"entries\" must be a list")
    shapes: dict = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            fail(f"entry {i} is not an object")
        key = []
        for name in _ENTRY_KEYS:
            value = entry.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "gemm" else 1):
                fail(f"entry {i}: {name}={value!r} is not a positive int")
            key.append(value)
        gemm, experts, hidden, inter, bucket = key
        if gemm not in (0, 1):
            fail(f"entry {i}: gemm={gemm!r} is not 0 or 1")
        if bucket & (bucket - 1):
            fail(f"entry {i}: rows_bucket={bucket} is not a power of two")
        kernels = entry.get("kernels", ["triton"])
        if not isinstance(kernels, list) or not kernels or set(kernels) - set(KERNELS):
            fail(f"entry {i}: kernels={kernels!r} is not a list of {', '.join(KERNELS)}")
        try:
            config = config_from_fields(gemm, entry.get("config"), entry.get("kernel", "triton"))
        except (TypeError, ValueError) as error:
            fail(f"entry {i}: {error}")
        if kernel_of(config) not in kernels:
            fail(f"entry {i}: its kernel {kernel_of(config)!r} is not among its kernels {kernels}")
        per_shape = shapes.setdefault((gemm, experts, hidden, inter), {})
        if bucket in per_shape:
            fail(f"entry {i}: a second entry for gemm={gemm} E_local={experts} H={hidden} I={inter} "
                 f"rows_bucket={bucket}")
        per_shape[bucket] = TunedEntry(config, against_ws=bool(set(kernels) - {"triton"}))
    return dict(shapes=shapes, data=data)


@functools.lru_cache(maxsize=4096)
def _lookup(path: str, gemm: int, experts: int, hidden: int, inter: int, bucket: int) -> TunedEntry | None:
    return _load_table(path)["shapes"].get((gemm, experts, hidden, inter), {}).get(bucket)
