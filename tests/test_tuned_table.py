"""The tuned grouped-GEMM table (kernels/grouped_gemm.py: tuned_config, default_config, default_configs) and the
`weave-moe tune` command, without a GPU: lookups from a table given by $WEAVE_MOE_TUNED_TABLE or the `table`
argument, rows buckets, fallbacks, malformed tables, and the command's refusal without CUDA.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from weave_moe import cli
from weave_moe.backends.weave.kernels import gemm_configs as gc
from weave_moe.commands import tune

SHAPE = dict(E_local=64, H=2048, I=768)  # Qwen3-30B-A3B at EP=2


def _entry(gemm, bucket, config, **shape):
    return dict(gemm=gemm, rows_bucket=bucket, **dict(SHAPE, **shape), config=dataclasses.asdict(config))


def _write(path, entries, **extra):
    path.write_text(json.dumps(dict(format=gc.TUNED_FORMAT, device="NVIDIA H200", entries=entries, **extra)))
    return path


TUNED0 = gc.analytical_configs(0)[1].with_(block_n=128, num_stages=5)
TUNED1 = gc.analytical_configs(1)[1].with_(block_m=64, num_warps=8, num_stages=3)


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A table with GEMM0 at buckets 16384 and 65536 and GEMM1 at 16384 for SHAPE, selected by the variable."""
    path = _write(tmp_path / "nvidia-h200.json", [
        _entry(0, 16384, TUNED0), _entry(0, 65536, TUNED0.with_(num_stages=3)), _entry(1, 16384, TUNED1)])
    monkeypatch.setenv(gc.TUNED_TABLE_ENV, str(path))
    gc.clear_tuned_cache()
    yield path
    gc.clear_tuned_cache()


@pytest.mark.parametrize("rows, bucket", [(0, 1), (1, 1), (2, 2), (3, 4), (5, 4), (6, 8), (11585, 8192),
                                          (11586, 16384), (12288, 16384), (16384, 16384), (23170, 16384),
                                          (23171, 32768), (49152, 65536)])
def test_rows_bucket_is_the_nearest_power_of_two_on_a_log_scale(rows, bucket):
    assert gc.rows_bucket(rows) == bucket


def test_device_key_normalises_the_device_name():
    assert gc.device_key("NVIDIA H200") == "nvidia-h200"
    assert gc.device_key("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    with pytest.raises(ValueError):
        gc.device_key(" -- ")


def test_the_layers_kernel_is_the_table_entry_measured_against_ws_else_the_ws_rule_else_triton(tmp_path, monkeypatch):
    """gemm_configs' "Kernels" order for a caller that may run the warp-specialised Gluon kernels: an entry whose
    candidates included them decides (whichever kernel won), else the Gluon kernels' rule (`ws_rule`) where it has a
    config, else a Triton entry, else the analytical config; a caller that may not never gets a Gluon config (a ws
    entry leaves its shape to the analytical rule); a gathering GEMM0 never gets the prefill Gluon kernel."""
    from weave_moe.backends.weave.kernels import ws_decode, ws_gemm

    E, H, I = SHAPE["E_local"], SHAPE["H"], SHAPE["I"]
    ws_config = ws_gemm.WsConfig.parse("64x256x128w4s2")
    path = _write(tmp_path / "t.json", [
        # 128 rows per expert (the ws rule's band): a Triton entry measured against ws candidates (Triton won)
        dict(_entry(0, 8192, TUNED0), kernels=["triton", "ws"]),
        # ... and one measured without them
        _entry(1, 8192, TUNED1),
        # 512 rows per expert (outside the band): a ws entry
        dict(_entry(0, 32768, ws_config), kernel="ws", config=dataclasses.asdict(ws_config), kernels=["triton", "ws"]),
        dict(_entry(1, 32768, ws_config), kernel="ws", config=dataclasses.asdict(ws_config), kernels=["triton", "ws"]),
    ])
    monkeypatch.setenv(gc.TUNED_TABLE_ENV, str(path))
    gc.clear_tuned_cache()
    try:
        def pick(gemm, rows, **options):
            return gc.default_config(gemm, rows, E, H, I, warp_specialized=True, **options)

        assert pick(0, 8192) == TUNED0                        # measured against ws: it decides
        assert pick(1, 8192) == ws_gemm.DEFAULT_CONFIG        # measured without: the ws rule first
        assert pick(0, 32768) == pick(1, 32768) == ws_config  # a ws entry
        assert pick(0, 32768, gathers=("triton", )) == gc.analytical_config(0, 32768, E)   # no gather rows in Gluon
        assert pick(0, 8192, gathers=("triton", )) == TUNED0
        assert pick(1, 2 ** 20) == gc.analytical_config(1, 2 ** 20, E)   # no entry, outside the rule's band
        assert pick(0, 64) == ws_decode.default_config(64, E)             # decode sizes: the decode form
        assert pick(0, 64, gathers=("triton", )) == ws_decode.default_config(64, E)
        # where only the Gluon GEMM0 reads the gather rows (KernelConfig.ws_gather, gemm0_gather off): the rule's
        # band as without it (above it the Triton GEMM0 after the gather launch measured faster)
        assert pick(0, 2 ** 20, gathers=("ws", )) == gc.analytical_config(0, 2 ** 20, E)
        assert pick(1, 2 ** 20, gathers=("ws", )) == gc.analytical_config(1, 2 ** 20, E)
        assert pick(0, 2 ** 20, gathers=("triton", "ws")) == gc.analytical_config(0, 2 ** 20, E)
        assert pick(0, 64, gathers=("ws", )) == ws_decode.default_config(64, E)
        # a caller without the Gluon kernels: Triton entries, else the analytical configs
        assert gc.default_config(0, 8192, E, H, I) == TUNED0 and gc.default_config(1, 8192, E, H, I) == TUNED1
        assert gc.default_config(0, 32768, E, H, I) == gc.analytical_config(0, 32768, E)
        assert gc.tuned_config(0, 32768, E, H, I) == ws_config
        # what a layer compiles first: the ws configs only for a caller that runs them
        plain = gc.default_configs(0, E, H, I)
        assert TUNED0 in plain and not any(isinstance(c, (ws_gemm.WsConfig, ws_decode.WsDecodeConfig)) for c in plain)
        every = gc.default_configs(0, E, H, I, warp_specialized=True)
        for rows in (1, 8, 64, 512, 4096, 8192, 32768, 2 ** 20):
            assert pick(0, rows) in every and pick(0, rows, gathers=("triton", )) in every
            assert pick(0, rows, gathers=("ws", )) in every
            assert gc.default_config(0, rows, E, H, I) in plain
    finally:
        gc.clear_tuned_cache()


@pytest.mark.parametrize("entry, message", [
    (dict(kernel="cuda"), "kernel: expected one of"),
    (dict(kernels="ws"), "is not a list of"),
    (dict(kernels=["ws"]), "its kernel 'triton' is not among its kernels"),
    (dict(kernel="ws"), "config: unknown fields"),
])
def test_a_malformed_kernel_entry_is_refused_naming_the_file(tmp_path, entry, message):
    path = _write(tmp_path / "bad.json", [dict(_entry(0, 8192, TUNED0), **entry)])
    with pytest.raises(ValueError, match=message) as error:
        gc.load_tuned_table(path)
    assert str(path) in str(error.value)
    gc.clear_tuned_cache()


def test_ws_configs_round_trip_through_their_compact_names():
    from weave_moe.backends.weave.kernels import ws_decode, ws_gemm

    for text in ("64x256x64w4s4", "128x256x64w8s4t", "64x256x64w4s3c2", "128x128x64w8s4p48r168", "64x256x128w4s2"):
        assert ws_gemm.WsConfig.parse(text).short == text
        assert gc.parse_ws_config(text) == ws_gemm.WsConfig.parse(text)
    for text in ("t16w64k128s8", "t8w128k64s6p48"):
        assert ws_decode.WsDecodeConfig.parse(text).short == text
        assert gc.parse_ws_config(text) == ws_decode.WsDecodeConfig.parse(text)
    for bad in ("64x256", "t16w64", "64x256x64w4s4c3", "128x256x64w8s4 t"):
        with pytest.raises(ValueError, match="config"):
            gc.parse_ws_config(bad)


def test_lookup_hits_the_shape_and_bucket_else_the_analytical_default(table):
    E, H, I = SHAPE["E_local"], SHAPE["H"], SHAPE["I"]
    assert gc.default_config(0, 16384, E, H, I) == TUNED0
    assert gc.default_config(0, 14000, E, H, I) == TUNED0  # same bucket
    assert gc.default_config(0, 60000, E, H, I) == TUNED0.with_(num_stages=3)
    assert gc.default_config(1, 16384, E, H, I) == TUNED1
    # no entry: another bucket, another shape, no shape given
    assert gc.default_config(1, 65536, E, H, I) == gc.analytical_config(1, 65536, E)
    assert gc.default_config(0, 16384, E, H, 1408) == gc.analytical_config(0, 16384, E)
    assert gc.default_config(0, 16384, 32, H, I) == gc.analytical_config(0, 16384, 32)
    assert gc.default_config(0, 16384, E) == gc.analytical_config(0, 16384, E)
    assert gc.tuned_config(1, 65536, E, H, I) is None
    with pytest.raises(ValueError, match="gemm"):
        gc.default_config(2, 16384, E, H, I)


def test_lookups_are_cached(table):
    E, H, I = SHAPE["E_local"], SHAPE["H"], SHAPE["I"]
    gc.default_config(0, 16384, E, H, I)
    loads = gc._load_table.cache_info().misses
    for rows in range(15000, 16000):
        gc.default_config(0, rows, E, H, I)
    assert gc._load_table.cache_info().misses == loads  # parsed once
    assert gc._lookup.cache_info().hits >= 1000  # one cached lookup per (shape, bucket)


def test_table_argument_overrides_the_variable(table, tmp_path):
    other = _write(tmp_path / "other.json", [_entry(0, 16384, TUNED0.with_(group_m=4))])
    assert gc.default_config(0, 16384, 64, 2048, 768, table=other) == TUNED0.with_(group_m=4)
    assert gc.default_config(0, 16384, 64, 2048, 768) == TUNED0


def test_no_table_means_the_analytical_default(monkeypatch, tmp_path):
    gc.clear_tuned_cache()
    monkeypatch.delenv(gc.TUNED_TABLE_ENV, raising=False)
    monkeypatch.setattr(gc, "_CUDA", False)  # no GPU: no device table
    assert gc.tuned_table_path() is None
    assert gc.default_config(0, 16384, 64, 2048, 768) == gc.analytical_config(0, 16384, 64)
    assert gc.default_configs(0, 64, 2048, 768) == gc.analytical_configs(0)
    # "off" switches a table off
    monkeypatch.setenv(gc.TUNED_TABLE_ENV, str(_write(tmp_path / "t.json", [_entry(0, 16384, TUNED0)])))
    assert gc.default_config(0, 16384, 64, 2048, 768) == TUNED0
    monkeypatch.setenv(gc.TUNED_TABLE_ENV, "off")
    assert gc.default_config(0, 16384, 64, 2048, 768) == gc.analytical_config(0, 16384, 64)
    gc.clear_tuned_cache()


def test_device_table_path_is_named_by_the_device_key(monkeypatch):
    gc.clear_tuned_cache()
    gc._device_table_path.cache_clear()
    monkeypatch.setattr(gc, "_CUDA", True)
    monkeypatch.setattr(gc.torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    try:
        assert gc.tuned_table_path(0) == gc.TUNED_DIR / "nvidia-h200.json"
    finally:
        gc._device_table_path.cache_clear()
        gc.clear_tuned_cache()


def test_default_configs_cover_every_table_entry_of_the_shape(table):
    E, H, I = SHAPE["E_local"], SHAPE["H"], SHAPE["I"]
    for gemm in (0, 1):
        allowed = gc.default_configs(gemm, E, H, I)
        analytical = gc.analytical_configs(gemm)
        assert allowed[:len(analytical)] == analytical and len(set(allowed)) == len(allowed)
        entries = [e for e in json.loads(table.read_text())["entries"] if e["gemm"] == gemm]
        for e in entries:
            assert gc.config_from_fields(gemm, e["config"]) in allowed
        assert len(allowed) == len(analytical) + len({json.dumps(e["config"], sort_keys=True) for e in entries}
                                                     - {json.dumps(dataclasses.asdict(c), sort_keys=True)
                                                        for c in analytical})
        for rows in (0, 1, 100, 154 * E, 11000, 16384, 30000, 65536, 200000):
            assert gc.default_config(gemm, rows, E, H, I) in allowed
    assert gc.default_configs(0) == gc.analytical_configs(0)  # without the shape: what default_config picks without it
    assert gc.default_configs(0, 32, 2048, 768) == gc.analytical_configs(0)  # another shape


@pytest.mark.parametrize("content, message", [
    ("{not json", "cannot be read as JSON"),
    (json.dumps([]), "format"),
    (json.dumps(dict(format="other/9", entries=[])), "format"),
    (json.dumps(dict(format=gc.TUNED_FORMAT, entries={})), "entries"),
    (json.dumps(dict(format=gc.TUNED_FORMAT, entries=[dict(_entry(0, 16384, TUNED0), rows_bucket=12288)])),
     "rows_bucket=12288"),
    (json.dumps(dict(format=gc.TUNED_FORMAT, entries=[dict(_entry(0, 16384, TUNED0), H="2048")])), "H='2048'"),
    (json.dumps(dict(format=gc.TUNED_FORMAT, entries=[dict(_entry(0, 16384, TUNED0), gemm=2)])), "gemm=2"),
    (json.dumps(dict(format=gc.TUNED_FORMAT, entries=[_entry(0, 16384, TUNED0), _entry(0, 16384, TUNED0)])),
     "a second entry"),
    (json.dumps(dict(format=gc.TUNED_FORMAT, entries=[dict(_entry(0, 16384, TUNED0),
                                                           config=dict(block_m=64))])), "missing fields"),
    (json.dumps(dict(format=gc.TUNED_FORMAT, entries=[dict(_entry(0, 16384, TUNED0),
                                                           config=dict(dataclasses.asdict(TUNED0), tile=3))])),
     "unknown fields"),
    (json.dumps(dict(format=gc.TUNED_FORMAT, entries=[_entry(1, 16384, TUNED1.with_(
        split_tail=True, epilogue=gc.EPILOGUE_TMA, flatten=False))])), "split_tail with epilogue=1"),
    (json.dumps(dict(format=gc.TUNED_FORMAT, entries=[_entry(0, 16384, TUNED0.with_(interleaved=False))])),
     "interleaved"),
    (json.dumps(dict(format=gc.TUNED_FORMAT, entries=[_entry(1, 16384, TUNED1.with_(block_n=96))])), "block_n=96"),
    (json.dumps(dict(format=gc.TUNED_FORMAT, entries=[_entry(1, 16384, TUNED1.with_(num_warps=2))])),
     "num_warps=2"),
])
def test_a_malformed_table_is_an_error_naming_the_file(content, message, tmp_path, monkeypatch):
    path = tmp_path / "broken.json"
    path.write_text(content)
    monkeypatch.setenv(gc.TUNED_TABLE_ENV, str(path))
    gc.clear_tuned_cache()
    try:
        for call in (lambda: gc.default_config(0, 16384, 64, 2048, 768),
                     lambda: gc.default_configs(0, 64, 2048, 768)):
            with pytest.raises(ValueError) as error:
                call()
            assert str(path) in str(error.value) and message in str(error.value), str(error.value)
    finally:
        gc.clear_tuned_cache()


def test_a_missing_table_named_by_the_variable_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv(gc.TUNED_TABLE_ENV, str(tmp_path / "absent.json"))
    gc.clear_tuned_cache()
    with pytest.raises(ValueError, match=f"{gc.TUNED_TABLE_ENV}.*absent.json"):
        gc.default_config(0, 16384, 64, 2048, 768)
    gc.clear_tuned_cache()


def test_shipped_tables_load():
    """Every table shipped in the package is one this version reads (named by its device key)."""
    for path in sorted(gc.TUNED_DIR.glob("*.json")):
        data = gc.load_tuned_table(path)["data"]
        assert data.get("device_key") == path.stem, path


@pytest.mark.parametrize("warp_specialized", [False, True])
def test_a_layer_compiles_every_config_it_may_pick_with_the_shipped_tables(warp_specialized):
    """What a layer compiles before its first call (`default_configs`) holds whatever `default_config` picks for any
    row count, gathering GEMM0 or not, on every shape of every shipped table (a config missing there would compile
    in the middle of a call, inside its CUDA graph)."""
    try:
        for path in sorted(gc.TUNED_DIR.glob("*.json")):
            for gemm, experts, hidden, inter in gc.load_tuned_table(path)["shapes"]:
                allowed = set(gc.default_configs(gemm, experts, hidden, inter, table=path,
                                                 warp_specialized=warp_specialized))
                for gathers in ((), ("triton", ), ("ws", ), ("triton", "ws")):
                    for rows in sorted({1, 2, 7, 8, 63, 64, 65, 100, 1000} | {
                            experts * m for m in (1, 8, 63, 64, 128, 256, 257, 1024)}):
                        config = gc.default_config(gemm, rows, experts, hidden, inter, table=path,
                                                   warp_specialized=warp_specialized, gathers=gathers)
                        assert config in allowed, (path.name, gemm, experts, hidden, inter, rows, gathers, config)
                        assert warp_specialized or isinstance(config, gc.GemmConfig)
    finally:
        gc.clear_tuned_cache()


def test_tune_without_a_gpu_refuses_with_a_message(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["tune", "--models", "qwen3-30b-a3b", "--emulate-ep", "2", "--tokens", "2048"]) == 2
    err = capsys.readouterr().err
    assert "weave-moe tune: needs a CUDA GPU" in err


def test_tune_refuses_an_unknown_model_before_looking_for_a_gpu(capsys):
    assert cli.main(["tune", "--models", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_tune_list_shows_shapes_and_candidates_without_a_gpu(capsys):
    assert cli.main(["tune", "--list", "--models", "qwen3-30b-a3b,deepseek-v2", "--emulate-ep", "2",
                     "--tokens", "2048,8192"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-30b-a3b, T=2048: 64 x 2048 x 768, 16384 rows -> 16384" in out
    assert "deepseek-v2, T=2048: 80 x 5120 x 1536, 12288 rows -> 16384" in out
    # GEMM0: the analytical decode tiles (16 rows, BLOCK_K 128) besides the grid's
    assert "GEMM0: 21 candidates" in out and "GEMM1: 20 candidates" in out


def test_tune_routing_option(capsys):
    from weave_moe.commands import tune

    assert tune.tune_routings("skewed, uniform,skewed", 3.0) == ("skewed", "uniform")
    for bad in ("", "zipf", "uniform,zipf"):
        with pytest.raises(ValueError, match="--routing"):
            tune.tune_routings(bad, 3.0)
    with pytest.raises(ValueError, match="--skew"):
        tune.tune_routings("skewed", 0.5)
    assert tune.tune_routings("uniform", 0.5) == ("uniform", )   # the skew only matters for skewed routing
    assert cli.main(["tune", "--list", "--models", "qwen3-30b-a3b", "--tokens", "2048",
                     "--routing", "uniform,skewed"]) == 0
    assert "timed on uniform, skewed routings (geomean)" in capsys.readouterr().out
    assert cli.main(["tune", "--list", "--models", "qwen3-30b-a3b", "--routing", "zipf"]) == 2
    assert "--routing" in capsys.readouterr().err


def test_tune_candidates_include_the_defaults_and_skip_what_cannot_work():
    for gemm in (0, 1):
        candidates, skipped = tune.candidate_configs(gemm, [64, 128], [128, 256], [64], [4, 8], [3, 4, 5])
        assert candidates[:len(gc.analytical_configs(gemm))] == list(gc.analytical_configs(gemm))
        assert len(set(candidates)) == len(candidates)
        for config in candidates:
            gc.check_config(gemm, config)
            assert config.block_m * config.block_n // (32 * config.num_warps) <= tune.MAX_ACC_REGS
            assert config.num_stages * (config.block_m + config.block_n) * config.block_k * 2 <= tune.HOPPER_SMEM_BYTES
        reasons = {tune.config_name(c): r for c, r in skipped}
        assert "registers" in reasons[f"128x256x64 w4 s3 e{candidates[0].epilogue}"]
        assert "shared memory" in reasons[f"128x256x64 w8 s5 e{candidates[0].epilogue}"]


def test_tune_split_tail_candidates_only_where_the_epilogue_allows():
    """--split-tail 0,1 adds the split-tail variant of each combination (both analytical defaults store through a
    masked or clipped epilogue, which can run half-height tail tiles; a TMA-store epilogue cannot: check_config, and
    the malformed-table test above)."""
    for gemm in (0, 1):
        candidates, _ = tune.candidate_configs(gemm, [64, 128], [128], [64], [8], [4], split_tail=[0, 1])
        tails = [c for c in candidates if c.split_tail]
        assert {c.block_m for c in tails} == {64, 128}, tails
        for config in tails:
            gc.check_config(gemm, config)
            assert tune.config_name(config).endswith(" tail") and config.with_(split_tail=False) in candidates
    with pytest.raises(ValueError, match="split_tail with epilogue=1"):
        gc.check_config(1, TUNED1.with_(split_tail=True, epilogue=gc.EPILOGUE_TMA, flatten=False))


def test_tune_epilogue_candidates():
    """--epilogue 0,3: each combination with each epilogue (the analytical defaults kept as they are)."""
    candidates, skipped = tune.candidate_configs(1, [128], [256], [64], [8], [4], epilogue=[0, 3])
    assert {c.epilogue for c in candidates if c.block_m == 128} == {0, 3}
    assert candidates[:2] == list(gc.analytical_configs(1))
    assert cli.main(["tune", "--list", "--models", "qwen3-30b-a3b", "--epilogue", "5"]) == 2


def test_tune_flatten_candidates():
    """--flatten 0,1: each combination with the loops pipelined as one and apart ("noflat" in the name)."""
    candidates, _ = tune.candidate_configs(1, [128], [256], [64], [8], [4], flatten=[0, 1], epilogue=[0, 3])
    wide = [c for c in candidates if c.block_m == 128]
    assert {(c.flatten, c.epilogue) for c in wide} == {(True, 0), (False, 0), (True, 3), (False, 3)}
    assert all(tune.config_name(c).endswith("noflat") == (not c.flatten) for c in candidates)
    assert cli.main(["tune", "--list", "--models", "qwen3-30b-a3b", "--flatten", "2"]) == 2


def test_tune_group_m_candidates():
    candidates, _ = tune.candidate_configs(0, [128], [256], [64], [8], [4], group_m=[8, 16])
    assert {c.group_m for c in candidates if c.block_m == 128} == {8, 16}
    assert any(tune.config_name(c).endswith(" g16") for c in candidates)
    assert cli.main(["tune", "--list", "--models", "qwen3-30b-a3b", "--group-m", "0"]) == 2


def test_tune_stream_k_candidates():
    for gemm in (0, 1):
        candidates, skipped = tune.candidate_configs(gemm, [16], [128], [128], [4], [4], epilogue=[2],
                                                     stream_k=[0, 1])
        assert {c.stream_k for c in candidates if c.block_m == 16} == {False, True}
        assert all(c.epilogue == 0 for c in candidates if c.stream_k)   # stream-K stores through masked stores
        assert any(tune.config_name(c).endswith(" sk") for c in candidates)
        assert not any("stream_k" in reason for _, reason in skipped)
    # not with split tails: refused up front, named
    _, skipped = tune.candidate_configs(1, [64], [128], [64], [4], [4], split_tail=[1], epilogue=[0], stream_k=[1])
    assert any("stream_k" in reason for _, reason in skipped)
    assert cli.main(["tune", "--list", "--models", "qwen3-30b-a3b", "--stream-k", "2"]) == 2


def test_tune_refuses_to_update_another_devices_table(tmp_path):
    """`tune --out` naming a table measured on another device (here the H200's, tuned on an H100) is refused before
    anything is measured, naming both; --replace starts it anew for this GPU; a table not yet written by a run (no
    device recorded) is taken."""
    out = tmp_path / "nvidia-h200.json"
    table = tune._start_table(out, replace=False, device_key="nvidia-h200")
    table.update(device="NVIDIA H200", device_key="nvidia-h200")
    tune._write_table(out, table)
    gc.clear_tuned_cache()
    with pytest.raises(ValueError, match=r"measured on NVIDIA H200 \(nvidia-h200\), and this GPU is nvidia-h100"):
        tune._start_table(out, replace=False, device_key="nvidia-h100-80gb-hbm3")
    assert tune._start_table(out, replace=False, device_key="nvidia-h200")["device_key"] == "nvidia-h200"
    assert "device_key" not in tune._start_table(out, replace=True, device_key="nvidia-h100-80gb-hbm3")
    gc.clear_tuned_cache()


def test_tune_records_round_trip_through_the_lookup(tmp_path):
    """What the command writes (its _record / _write_table, fed made-up timings here) is what default_config reads:
    an entry only where the best beats the default by --min-gain, older records of a re-measured key replaced."""
    out = tmp_path / "nvidia-h200.json"
    table = tune._start_table(out, replace=False, device_key="nvidia-h200")
    table["meta"] = dict(date="2026-12-01T00:00:00+00:00", commit="abc")
    shape = dict(model="qwen3-30b-a3b", tokens=2048, rows=16384, rows_bucket=16384, **SHAPE)
    default0, default1 = gc.analytical_config(0, 16384, 64), gc.analytical_config(1, 16384, 64)
    r0 = tune._record(table, shape, 0, default0, [(1.0, default0, 1e-3), (0.8, TUNED0, 1e-3)], 0.05, 2,
                      gathered=True)
    r1 = tune._record(table, shape, 1, default1, [(1.0, default1, 1e-3), (0.98, TUNED1, 1e-3)], 0.05, 2)
    assert r0["written"] and not r1["written"]
    assert r0["gathered"] and "gathered" not in r1   # how GEMM0 was timed (KernelConfig.gemm0_gather)
    tune._write_table(out, table)
    gc.clear_tuned_cache()
    try:
        assert gc.default_config(0, 16384, 64, 2048, 768, table=out) == TUNED0
        assert gc.default_config(1, 16384, 64, 2048, 768, table=out) == default1  # within --min-gain: not written
        # re-measured: the new record replaces the old one
        table = tune._start_table(out, replace=False, device_key="nvidia-h200")
        assert [e["gemm"] for e in table["measured_default"]] == [1]
        table["meta"] = dict(date="2026-12-02T00:00:00+00:00", commit="def")
        tune._record(table, shape, 0, default0, [(1.0, default0, 1e-3), (0.99, TUNED0, 1e-3)], 0.05, 2)
        tune._write_table(out, table)
        gc.clear_tuned_cache()
        assert gc.default_config(0, 16384, 64, 2048, 768, table=out) == default0
        assert len(json.loads(out.read_text())["measured_default"]) == 2
    finally:
        gc.clear_tuned_cache()


def test_tune_ws_candidates_and_their_records_decide_as_measured(tmp_path, capsys):
    """`weave-moe tune --ws`: the Gluon candidates parse ("rule": the Gluon kernels' own configs), join every shape's
    candidates but a gathered GEMM0's, the default is what the layer runs without an entry (the rule's config in its
    band), and the records name the winner's kernel and the kernels measured, which the lookup then follows."""
    from weave_moe.backends.weave.kernels import ws_decode, ws_gemm

    ws = tune.ws_candidates("rule, 64x256x128w4s2", layer_ws=True)
    assert ws[:len(ws_gemm.default_configs())] == list(ws_gemm.default_configs())
    assert set(ws_decode.default_configs()) <= set(ws) and ws[-1] == ws_gemm.WsConfig.parse("64x256x128w4s2")
    # auto: the rule's configs and the 192-row tiles (no rule picks them; a table may)
    assert tune.ws_candidates("auto", layer_ws=True) == tune.ws_candidates("rule", layer_ws=True) + list(
        ws_gemm.ROW_PART_CONFIGS)
    assert tune.ws_candidates("", layer_ws=True) == tune.ws_candidates("none", layer_ws=True) == []
    # --group-m: each prefill-form candidate also with each group_m (the 192-row tiles ran 5-6% faster with GROUP_M 1
    # or 2 than 8 on an H100); the decode form has no group order
    wsd = ws_decode.default_configs()[0]
    plain = ws_gemm.WsConfig.parse("192x128x64w4s4")
    assert tune.with_group_m([plain, wsd], (1, 8)) == [plain, wsd, ws_gemm.WsConfig.parse("192x128x64w4s4g1")]
    assert [c.group_m for c in tune.with_group_m([plain], (2, 1))] == [8, 2, 1]
    assert tune.with_group_m([wsd], (2, )) == [wsd]
    for text in ("", "none", "auto"):   # the layer runs no Gluon kernel (not sm_90, or ws_gemm off): none
        assert tune.ws_candidates(text, layer_ws=False) == []
    with pytest.raises(ValueError, match="would not run the Gluon kernels"):
        tune.ws_candidates("rule", layer_ws=False)
    with pytest.raises(ValueError, match="64x2"):
        tune.ws_candidates("64x2", layer_ws=True)
    assert cli.main(["tune", "--list", "--models", "qwen3-30b-a3b", "--tokens", "2048", "--ws", "64x256x64w4s4"]) == 0
    assert "warp-specialised candidates (both GEMMs; not a gathered GEMM0): ws 64x256x64 w4 s4" in capsys.readouterr().out
    assert cli.main(["tune", "--list", "--models", "qwen3-30b-a3b", "--tokens", "2048"]) == 0   # auto: the rule's
    assert f"not a gathered GEMM0): {tune.config_name(ws_gemm.DEFAULT_CONFIG)}" in capsys.readouterr().out
    assert cli.main(["tune", "--list", "--ws", "64x256"]) == 2
    assert "64x256" in capsys.readouterr().err

    triton = [TUNED0, gc.analytical_config(0, 8192, 64)]
    default = gc.untuned_config(0, 8192, 64, warp_specialized=True)
    assert default == ws_gemm.DEFAULT_CONFIG   # 128 rows per expert: the rule's band
    assert tune.shape_candidates(triton + ws, default, gathered=False) == triton + ws
    gathered_default = gc.untuned_config(0, 8192, 64, warp_specialized=True, gathers=("triton", ))
    assert tune.shape_candidates(triton + ws, gathered_default, gathered=True) == triton   # analytical among them
    assert tune.shape_candidates(triton, default, gathered=False) == triton + [default]

    out = tmp_path / "nvidia-h100.json"
    table = tune._start_table(out, replace=False, device_key="nvidia-h200")
    table["meta"] = dict(date="2026-12-06T00:00:00+00:00", commit="abc")
    shape = dict(model="qwen3-30b-a3b", tokens=1024, rows=8192, rows_bucket=8192, **SHAPE)
    both = ["triton", "ws", "ws_decode"]
    # GEMM0: a Triton config beats the rule's; GEMM1: the rule's wins (no entry); GEMM0 at 4096 rows: a ws config
    r0 = tune._record(table, shape, 0, default, [(1.0, default, 1e-3), (0.8, TUNED0, 1e-3)], 0.05, 2, kernels=both)
    r1 = tune._record(table, shape, 1, default, [(1.0, default, 1e-3), (0.99, TUNED1, 1e-3)], 0.05, 2, kernels=both)
    wide = ws_gemm.WsConfig.parse("64x256x128w4s2")
    shape4 = dict(shape, rows=32768, rows_bucket=32768, tokens=4096)
    base4 = gc.analytical_config(0, 32768, 64)
    r4 = tune._record(table, shape4, 0, base4, [(1.0, base4, 1e-3), (0.7, wide, 1e-3)], 0.05, 2, kernels=both)
    assert r0["written"] and not r1["written"] and r4["written"]
    entries = {(e["gemm"], e["rows_bucket"]): e for e in table["entries"]}
    assert entries[0, 8192]["kernel"] == "triton" and entries[0, 32768]["kernel"] == "ws"
    assert entries[0, 8192]["kernels"] == both and table["measured_default"][0]["kernels"] == both
    tune._write_table(out, table)
    gc.clear_tuned_cache()
    try:
        def pick(gemm, rows, **options):
            return gc.default_config(gemm, rows, 64, 2048, 768, table=out, **options)

        assert pick(0, 8192, warp_specialized=True) == TUNED0    # measured against the rule's config: Triton won
        assert pick(1, 8192, warp_specialized=True) == ws_gemm.DEFAULT_CONFIG
        assert pick(0, 32768, warp_specialized=True) == wide
        assert pick(0, 32768) == base4                            # a caller without the Gluon kernels
    finally:
        gc.clear_tuned_cache()


def test_cold_rotations_cover_the_l2_several_times_within_the_experts():
    l2 = 50 << 20
    # 8 experts of 6 MiB each: 48 MiB a launch -> ceil(4 * 50 / 48) = 5 rotations
    assert tune.cold_rotations(8 * (6 << 20), l2, 64) == 5
    assert tune.cold_rotations(8 * (6 << 20), l2, 3) == 3          # never more rotations than experts
    assert tune.cold_rotations(tune.COLD_L2_FACTOR * l2, l2, 64) == 1  # reads enough by itself
    assert tune.cold_rotations(10 * l2, l2, 64) == 1
    assert tune.cold_rotations(0, l2, 64) == 1
    for rotations in range(1, 9):
        launch = 4 * l2 // rotations + 1
        r = tune.cold_rotations(launch, l2, 64)
        assert r * launch >= tune.COLD_L2_FACTOR * l2 and (r - 1) * launch < tune.COLD_L2_FACTOR * l2


def test_rotated_counts_keep_the_rows_and_move_them_to_other_experts():
    import torch

    counts = torch.zeros(64, dtype=torch.int64)
    counts[[3, 17, 40]] = torch.tensor([2, 5, 1])
    for r in range(8):
        rolled = tune.rotated_counts(counts, r, 8)
        assert int(rolled.sum()) == 8 and sorted(rolled[rolled > 0].tolist()) == [1, 2, 5]
        assert set(torch.nonzero(rolled).flatten().tolist()) == {(e + 8 * r) % 64 for e in (3, 17, 40)}
    assert torch.equal(tune.rotated_counts(counts, 0, 8), counts)


def test_tune_pairs_write_the_fastest_pair_by_its_gain_over_the_default_pair(tmp_path):
    """--pairs: GEMM0 -> GEMM1 timed back to back; the configs of the fastest pair are written (each GEMM's entry
    records the pair), even where one of them is not the fastest alone, and only by the pair's gain."""
    out = tmp_path / "nvidia-h200.json"
    table = tune._start_table(out, replace=False, device_key="nvidia-h200")
    table["meta"] = dict(date="2026-12-03T00:00:00+00:00", commit="abc")
    shape = dict(model="qwen3-30b-a3b", tokens=2048, rows=16384, rows_bucket=16384, **SHAPE)
    default0, default1 = gc.analytical_config(0, 16384, 64), gc.analytical_config(1, 16384, 64)
    alone0 = [(1.0, default0, 1e-3), (0.8, TUNED0, 1e-3)]
    alone1 = [(1.0, default1, 1e-3), (0.9, TUNED1, 1e-3)]   # TUNED1 fastest alone ...
    timed = {(TUNED0, TUNED1): 1.9, (TUNED0, default1): 1.6, (default0, TUNED1): 1.95, (default0, default1): 2.0}
    chosen = tune.pair_choice(timed, timed[default0, default1])   # ... but TUNED0 -> default1 is the fastest pair
    assert chosen[0]["config"] == TUNED0 and chosen[1]["config"] == default1 and chosen[0]["pairs_measured"] == 4
    r0 = tune._record(table, shape, 0, default0, alone0, 0.05, 2, pair=chosen[0])
    r1 = tune._record(table, shape, 1, default1, alone1, 0.05, 2, pair=chosen[1])
    assert r0["written"] and not r1["written"]   # GEMM1's pair config is its default: nothing to write
    assert abs(r0["gain"] - 0.25) < 1e-9 and r0["pair"] == [tune.config_name(TUNED0), tune.config_name(default1)]
    assert r0["ms"] == 0.8 and r0["pair_ms"] == 1.6
    tune._write_table(out, table)
    gc.clear_tuned_cache()
    try:
        assert gc.default_config(0, 16384, 64, 2048, 768, table=out) == TUNED0
        assert gc.default_config(1, 16384, 64, 2048, 768, table=out) == default1
    finally:
        gc.clear_tuned_cache()


def test_tune_pairs_need_both_gemms(capsys):
    assert cli.main(["tune", "--gemms", "0", "--pairs", "3", "--list"]) == 2
    assert "--pairs" in capsys.readouterr().err


def test_tune_confirmation_rounds_alternate_and_decide_by_the_median():
    """--confirm: the default and the fastest candidates of the first pass re-timed in rounds of alternating order;
    the entry is decided by the medians over the rounds, not by the one pass (a candidate that was fast once, e.g.
    timed right after an idle GPU's pause, loses its place)."""
    assert tune.confirm_order(["a", "b", "c"], 3) == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    base = gc.GemmConfig()
    lucky, steady, slow, default = (base.with_(num_stages=n) for n in (2, 3, 5, 4))
    measured = [(1.0, lucky, 1e-3), (1.2, steady, 1e-3), (1.3, slow, 1e-3), (1.4, default, 1e-3),
                (1.9, base.with_(group_m=4), 1e-3)]
    truth = {lucky: [1.5, 1.6, 1.5], steady: [1.2, 1.1, 1.2], slow: [1.3, 1.3, 1.3], default: [1.4, 1.35, 1.45]}
    calls = []

    def time_ms(config):
        calls.append(config)
        return truth[config][sum(c == config for c in calls) - 1]

    confirmed = tune.confirm_measured(measured, default, 3, time_ms)
    assert calls == tune.confirm_order([lucky, steady, slow, default], 3)
    assert [c for _, c, _ in confirmed] == [steady, slow, default, lucky]   # only the re-timed ones
    assert confirmed[0][0] == 1.2 and confirmed[3][0] == 1.5
    # the default is re-timed even when it is not among the fastest
    calls.clear()
    tune.confirm_measured([(0.9, lucky, 0), (1.0, steady, 0), (1.1, slow, 0), (1.2, base.with_(group_m=4), 0),
                           (2.0, default, 0)], default, 1, lambda config: calls.append(config) or 1.0)
    assert default in calls and base.with_(group_m=4) not in calls
    assert cli.main(["tune", "--list", "--models", "qwen3-30b-a3b", "--confirm", "-1"]) == 2
