"""weave_moe.hf and weave_moe.checkpoint against transformers 5 (CPU, tiny models built from configs, no hub).

Tolerances: the registered implementation against transformers' eager experts on the same inputs is held to 1e-2
relative Frobenius error, the bound `weave_moe.reference` derives for bf16 backends; eager rounds more than the layer
does (gate/up, each expert's output, its weighted copy and every partial sum to bf16), which measures ~0.5% here.
With the "reference" backend the layer's output must equal `reference_moe` of the same bf16 inputs bit for bit.
A whole model's logits, where near-tied routing decisions may flip between two bf16 computations, are compared on
Qwen3-MoE only (softmax top-k, no ties at these sizes) with the example's 2e-2 (reason in examples/hf_generate.py).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is built locally: never wait on the network
transformers = pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("safetensors")

import weave_moe.hf as weave_hf  # noqa: E402
from weave_moe.checkpoint import CheckpointIndex, experts_prefix_candidates, load_rank_experts  # noqa: E402
from weave_moe.models import MoESpec  # noqa: E402
from weave_moe.reference import DEFAULT_TOLERANCE, moe_error, reference_moe  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_generate.py"
_TINY = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             num_experts_per_tok=2, initializer_range=0.1)
_DEEPSEEK_ATTENTION = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                           first_k_dense_replace=0)


@dataclasses.dataclass(frozen=True)
class Family:
    config_class: str
    kwargs: dict
    expected: tuple  # (E, k, H, I, shared experts, shared width)

    def config(self, **overrides):
        return getattr(transformers, self.config_class)(**{**_TINY, **self.kwargs, **overrides})


FAMILIES = [
    Family("Qwen2MoeConfig", dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                  intermediate_size=64), (8, 2, 64, 32, 1, 48)),
    Family("Qwen3MoeConfig", dict(num_experts=8, moe_intermediate_size=32, intermediate_size=64, head_dim=16),
           (8, 2, 64, 32, 0, 0)),
    Family("Qwen3_5MoeTextConfig", dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=24,
                                        head_dim=16), (8, 2, 64, 32, 1, 24)),
    Family("DeepseekV2Config", dict(n_routed_experts=8, moe_intermediate_size=32, n_shared_experts=2,
                                    intermediate_size=64, q_lora_rank=None, **_DEEPSEEK_ATTENTION),
           (8, 2, 64, 32, 2, 32)),
    Family("DeepseekV3Config", dict(n_routed_experts=8, moe_intermediate_size=32, n_shared_experts=1,
                                    intermediate_size=64, q_lora_rank=32, n_group=2, topk_group=1,
                                    **_DEEPSEEK_ATTENTION), (8, 2, 64, 32, 1, 32)),
    Family("MixtralConfig", dict(num_local_experts=8, intermediate_size=32, head_dim=16), (8, 2, 64, 32, 0, 0)),
    Family("OlmoeConfig", dict(num_experts=8, intermediate_size=32), (8, 2, 64, 32, 0, 0)),
    Family("PhimoeConfig", dict(num_local_experts=8, intermediate_size=32), (8, 2, 64, 32, 0, 0)),
]
_BY_NAME = {family.config_class: family for family in FAMILIES}


def _model(family: Family, dtype=torch.bfloat16, implementation="eager"):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(family.config(), dtype=dtype,
                                                         experts_implementation=implementation).eval()


def _experts_modules(model) -> list[tuple[str, torch.nn.Module]]:
    return [(name, module) for name, module in model.named_modules() if weave_hf._is_experts_module(module)]


def _routing(num_tokens: int, spec: MoESpec, dtype, seed: int = 0):
    """Random distinct top-k ids [T, k] int64 and positive weights [T, k] in `dtype`, as a router makes them."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, spec.num_experts, generator=generator)
    weights, ids = scores.topk(spec.top_k, dim=-1)
    return ids, weights.to(dtype)


# ---------------------------------------------------------------------------------------------- MoESpec.from_hf_config


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.config_class)
def test_from_hf_config_reads_each_family(family):
    spec = MoESpec.from_hf_config(family.config())
    assert (spec.num_experts, spec.top_k, spec.hidden_size, spec.intermediate_size, spec.num_shared_experts,
            spec.shared_intermediate_size) == family.expected


def test_from_hf_config_reads_the_text_config_of_qwen3_5():
    config = transformers.Qwen3_5MoeConfig(text_config=_BY_NAME["Qwen3_5MoeTextConfig"].config().to_dict())
    assert MoESpec.from_hf_config(config).intermediate_size == 32


def test_from_hf_config_matches_the_registered_shapes():
    # The defaults of these config classes are the released models' shapes.
    assert MoESpec.from_hf_config(transformers.Qwen3MoeConfig()).to_dict() | {"name": "qwen3-30b-a3b"} == \
        MoESpec.from_name("qwen3-30b-a3b").to_dict()
    assert MoESpec.from_hf_config(transformers.DeepseekV3Config()).to_dict() | {"name": "deepseek-v3"} == \
        MoESpec.from_name("deepseek-v3").to_dict()


@pytest.mark.parametrize("config, message", [
    (lambda: transformers.GptOssConfig(), "biases"),
    (lambda: transformers.LlamaConfig(), "not a supported family"),
    (lambda: _BY_NAME["Qwen3MoeConfig"].config(hidden_act="gelu"), "SiLU"),
    (lambda: transformers.DeepseekV2Config(), "num_experts_per_tok"),  # its default top-k is None
], ids=["gpt_oss", "llama", "gelu", "no_top_k"])
def test_from_hf_config_rejects_what_does_not_fit(config, message):
    with pytest.raises(ValueError, match=message):
        MoESpec.from_hf_config(config())


@pytest.mark.parametrize("attribute, value, message", [
    ("has_bias", True, "biases"), ("is_concatenated", False, "interleaved"), ("is_transposed", True, "transposed"),
    ("act_fn", torch.nn.GELU(), "GELU"),
])
def test_experts_spec_rejects_a_module_that_does_not_fit(attribute, value, message):
    _, module = _experts_modules(_model(_BY_NAME["Qwen3MoeConfig"]))[0]
    setattr(module, attribute, value)
    with pytest.raises(ValueError, match=message):
        weave_hf.experts_spec(module)


def test_gpt_oss_experts_refuse_to_run_through_weave():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    weave_hf.register()
    config = transformers.GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=8)
    config._experts_implementation = "weave"
    module = GptOssExperts(config)
    with pytest.raises(ValueError, match="does not fit"):
        weave_hf.experts_spec(module)
    ids, weights = _routing(3, MoESpec(8, 2, 64, 32), torch.float32)
    with torch.no_grad(), pytest.raises(ValueError, match="clamped SwiGLU"):
        module(torch.randn(3, 64), ids, weights)


# ---------------------------------------------------------------------------------------------- checkpoint loading


def _save_fused(model, directory: Path) -> None:
    """The transformers 5 in-memory naming (P.gate_up_proj [E, 2I, H]), as a fused checkpoint would hold it."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()},
              str(directory / "model.safetensors"))


@pytest.mark.parametrize("family_name, naming", [
    ("Qwen3MoeConfig", "per_expert"),      # save_pretrained writes P.{j}.gate_proj.weight ...
    ("MixtralConfig", "per_expert"),       # ... and Mixtral's block_sparse_moe.experts.{j}.w1/w3/w2
    ("Qwen3MoeConfig", "sharded"),         # several files + model.safetensors.index.json
    ("OlmoeConfig", "fused"),
    ("OlmoeConfig", "fused_fp32"),         # converted to bf16 on reading
])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_load_rank_experts_is_the_rank_slice_bitwise(tmp_path, family_name, naming, world_size):
    model = _model(_BY_NAME[family_name], dtype=torch.float32 if naming == "fused_fp32" else torch.bfloat16)
    if naming.startswith("fused"):
        _save_fused(model, tmp_path)
    else:
        model.save_pretrained(tmp_path, max_shard_size="40KB" if naming == "sharded" else "5GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == (naming == "sharded")
    with CheckpointIndex(tmp_path) as index:
        for name, module in _experts_modules(model):
            spec = weave_hf.experts_spec(module)
            rows = spec.num_experts // world_size
            for rank in range(world_size):
                w13, w2 = load_rank_experts(index, experts_prefix_candidates(name), spec, rank=rank,
                                            world_size=world_size)
                assert w13.dtype == w2.dtype == torch.bfloat16
                expected = [weight.detach()[rank * rows:(rank + 1) * rows].to(torch.bfloat16)
                            for weight in (module.gate_up_proj, module.down_proj)]
                assert torch.equal(w13, expected[0]) and torch.equal(w2, expected[1])


def test_load_rank_experts_checks_shapes_counts_dtypes_and_names(tmp_path):
    model = _model(_BY_NAME["Qwen3MoeConfig"])
    model.save_pretrained(tmp_path / "per_expert")
    name, module = _experts_modules(model)[0]
    spec = weave_hf.experts_spec(module)
    with pytest.raises(ValueError, match=r"gate_proj.weight.*shape \[32, 64\], expected \[16, 64\]"):
        load_rank_experts(tmp_path / "per_expert", name, dataclasses.replace(spec, intermediate_size=16))
    with pytest.raises(ValueError, match="8 experts .* expected num_experts=16"):
        load_rank_experts(tmp_path / "per_expert", name, dataclasses.replace(spec, num_experts=16))
    with pytest.raises(KeyError, match="no experts"):
        load_rank_experts(tmp_path / "per_expert", "model.layers.0.mlp.not_experts", spec)
    with pytest.raises(ValueError, match="divisor"):
        load_rank_experts(tmp_path / "per_expert", name, spec, world_size=3)
    from safetensors.torch import save_file

    (tmp_path / "fp8").mkdir()
    save_file({f"{name}.gate_up_proj": module.gate_up_proj.detach().to(torch.float8_e4m3fn),
               f"{name}.down_proj": module.down_proj.detach().to(torch.float8_e4m3fn)},
              str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(TypeError, match="F8_E4M3.*quantized"):
        load_rank_experts(tmp_path / "fp8", name, spec)


# ---------------------------------------------------------------------------------------------- the implementation


def test_register_is_idempotent_and_keeps_transformers_names():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert weave_hf.register() == "weave"
    first = ALL_EXPERTS_FUNCTIONS["weave"]
    weave_hf.register()
    assert ALL_EXPERTS_FUNCTIONS["weave"] is first
    for name in ("grouped_mm", "eager"):
        with pytest.raises(ValueError, match="transformers' own"):
            weave_hf.register(name)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.config_class)
def test_each_family_matches_eager_experts_on_the_same_inputs(family):
    weave_hf.register("weave-test-nccl", backend="nccl")
    model = _model(family)
    spec = MoESpec.from_hf_config(family.config())
    for layer, (_, module) in enumerate(_experts_modules(model)):
        x = torch.randn(13, spec.hidden_size, generator=torch.Generator().manual_seed(layer)).to(torch.bfloat16)
        # DeepSeek routers hand fp32 weights to the experts, the others the model's dtype
        ids, weights = _routing(13, spec, torch.float32 if "Deepseek" in family.config_class else torch.bfloat16)
        with torch.no_grad():
            model.set_experts_implementation("eager")
            eager = module(x, ids, weights)
            model.set_experts_implementation("weave-test-nccl")
            ours = module(x, ids, weights)
        assert ours.dtype == eager.dtype == torch.bfloat16
        assert moe_error(ours, eager)[0] <= DEFAULT_TOLERANCE


@pytest.mark.parametrize("num_tokens", [1, 7, 40])  # 40 > max_tokens_per_rank: split into pieces at EP = 1
def test_reference_backend_gives_reference_moe_bitwise(num_tokens):
    weave_hf.register("weave-test-reference", backend="reference", max_tokens_per_rank=16)
    model = _model(_BY_NAME["Qwen3MoeConfig"], implementation="weave-test-reference")
    _, module = _experts_modules(model)[1]
    spec = weave_hf.experts_spec(module)
    x = torch.randn(num_tokens, spec.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    ids, weights = _routing(num_tokens, spec, torch.bfloat16)
    with torch.no_grad():
        ours = module(x, ids, weights)
        pieces = [reference_moe(x[s:s + 16], ids[s:s + 16], weights[s:s + 16].float(), module.gate_up_proj,
                                module.down_proj) for s in range(0, num_tokens, 16)]
    assert torch.equal(ours, torch.cat(pieces))


def test_new_weights_are_picked_up_after_the_first_call():
    weave_hf.register("weave-test-reference", backend="reference", max_tokens_per_rank=16)
    model = _model(_BY_NAME["Qwen3MoeConfig"], implementation="weave-test-reference")
    _, module = _experts_modules(model)[0]
    spec = weave_hf.experts_spec(module)
    x = torch.randn(5, spec.hidden_size, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    ids, weights = _routing(5, spec, torch.bfloat16)
    with torch.no_grad():
        module(x, ids, weights)
        module.down_proj.data = -module.down_proj.data  # new storage under the same Parameter
        ours = module(x, ids, weights)
        truth = reference_moe(x, ids, weights.float(), module.gate_up_proj, module.down_proj)
    assert torch.equal(ours, truth)


def test_fp32_model_gets_fp32_output_close_to_eager():
    weave_hf.register()
    model = _model(_BY_NAME["MixtralConfig"], dtype=torch.float32)
    _, module = _experts_modules(model)[0]
    spec = weave_hf.experts_spec(module)
    x = torch.randn(9, spec.hidden_size, generator=torch.Generator().manual_seed(5))
    ids, weights = _routing(9, spec, torch.float32)
    with torch.no_grad():
        eager = module(x, ids, weights)
        model.set_experts_implementation("weave")
        ours = module(x, ids, weights)
    assert ours.dtype == torch.float32
    assert moe_error(ours, eager)[0] <= DEFAULT_TOLERANCE  # the layer's bf16 against fp32: a few roundings


def test_whole_model_logits_match_eager_and_gradients_are_refused():
    weave_hf.register()
    model = _model(_BY_NAME["Qwen3MoeConfig"])
    tokens = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model(tokens).logits.float()
        model.set_experts_implementation("weave")
        ours = model(tokens).logits.float()
    assert moe_error(ours, eager)[0] <= 2e-2
    with pytest.raises(RuntimeError, match="inference only"):
        model(tokens)


def test_load_local_experts_keeps_the_rank_slice_and_matches(tmp_path):
    weave_hf.register()
    family = _BY_NAME["Qwen3MoeConfig"]
    _model(family).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                              experts_implementation="weave").eval()
    eager = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                              experts_implementation="eager").eval()
    assert weave_hf.load_local_experts(model, tmp_path) == 2
    for (_, ours), (_, full) in zip(_experts_modules(model), _experts_modules(eager)):
        assert torch.equal(ours.gate_up_proj, full.gate_up_proj) and not ours.gate_up_proj.requires_grad
    tokens = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert moe_error(model(tokens).logits.float(), eager(tokens).logits.float())[0] <= 2e-2
    with pytest.raises(ValueError, match="no transformers experts"):
        weave_hf.load_local_experts(torch.nn.Linear(2, 2), tmp_path)


# ---------------------------------------------------------------------------------------------- the example


@pytest.mark.slow
def test_hf_generate_example_on_two_gloo_ranks(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(EXAMPLE), "--new-tokens", "3", "--checkpoint-dir", str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("routing agrees") == 6, result.stdout  # 2 ranks x 3 steps, each held to the tolerance
    assert result.stdout.count(": OK") == 2, result.stdout


def _too_many_tokens_on_one_rank(rank: int, world_size: int) -> list[str]:
    """Rank 1 hands its experts more tokens than max_tokens_per_rank: every rank raises in that call (no peer left
    waiting), and the next call works."""
    weave_hf.register("weave-test-ep", backend="nccl", max_tokens_per_rank=8)
    model = _model(_BY_NAME["Qwen3MoeConfig"], implementation="weave-test-ep")
    _, module = _experts_modules(model)[0]
    spec = weave_hf.experts_spec(module)
    outcomes = []
    for num_tokens in ((5, 12)[rank], 5):
        x = torch.randn(num_tokens, spec.hidden_size, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
        ids, weights = _routing(num_tokens, spec, torch.bfloat16, seed=rank)
        try:
            with torch.no_grad():
                module(x, ids, weights)
            outcomes.append("ok")
        except Exception as error:  # noqa: BLE001 - the outcome is what the test checks
            outcomes.append(type(error).__name__)
    return outcomes


def test_too_many_tokens_on_one_rank_raises_on_every_rank_at_ep2():
    from weave_moe.testing import run_distributed

    results = run_distributed(_too_many_tokens_on_one_rank, 2, timeout_s=120)
    assert results[1] == ["ValueError", "ok"], results
    assert results[0] == ["PeerError", "ok"], results


def test_per_module_layers_are_one_per_module_loaded_once(monkeypatch):
    """register(per_module=True): each experts module gets its own layer, which loads the module's experts on its
    first call only (the weave backend's resident call keeps its graphs); outputs equal the shared layer's."""
    weave_hf.register("weave-test-shared", backend="reference", max_tokens_per_rank=16)
    weave_hf.register("weave-test-per-module", backend="reference", max_tokens_per_rank=16, per_module=True)
    model = _model(_BY_NAME["Qwen3MoeConfig"])
    modules = [module for _, module in _experts_modules(model)]
    spec = weave_hf.experts_spec(modules[0])
    x = torch.randn(6, spec.hidden_size, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    ids, weights = _routing(6, spec, torch.bfloat16)
    per_module = weave_hf._IMPLEMENTATIONS["weave-test-per-module"]
    loads = []
    load_experts = weave_hf.ExpertParallelMoE.load_experts
    monkeypatch.setattr(weave_hf.ExpertParallelMoE, "load_experts",
                        lambda layer, w13, w2: (loads.append(id(layer)), load_experts(layer, w13, w2)))
    with torch.no_grad():
        model.set_experts_implementation("weave-test-shared")
        shared = [module(x, ids, weights) for module in modules]
        assert len(loads) == len(modules), "the shared layer loads each module's experts on its call"
        loads.clear()
        model.set_experts_implementation("weave-test-per-module")
        for _ in range(3):
            ours = [module(x, ids, weights) for module in modules]
            assert all(torch.equal(a, b) for a, b in zip(ours, shared))
    layers = [id(per_module.module_layers[module][1]) for module in modules]
    assert len(set(layers)) == len(modules) >= 2, "one layer per experts module"
    assert sorted(loads) == sorted(layers), "each per-module layer loads its experts once, on its first call"
    assert weave_hf.register("weave-test-per-module", backend="reference", max_tokens_per_rank=16,
                             per_module=True) == "weave-test-per-module"
    assert weave_hf._IMPLEMENTATIONS["weave-test-per-module"] is per_module, "same settings: the same implementation"
    with pytest.raises(TypeError, match="per_module"):
        weave_hf.register("weave-test-bad", per_module="yes")


@pytest.mark.parametrize("per_module", [False, True])
def test_weave_layers_hold_the_weights_as_the_call_needs(monkeypatch, per_module):
    """The weave layers the integration makes on a GPU (their options, without building one): a per-module layer
    keeps the module's weights as they are (KernelConfig.interleave_w13 off: no copy of w13, the grouped GEMM0 as two
    MMAs) and makes the resident call; the shared layer makes the host-driven call (it swaps weights every call).
    On a GPU older than Hopper, which the weave kernels do not run on, the layer is the nccl backend's."""
    from weave_moe.backends.weave import KernelConfig

    made = []
    monkeypatch.setattr(weave_hf, "ExpertParallelMoE", lambda spec, **options: made.append(options) or "layer")
    monkeypatch.delenv("WEAVE_MOE_KERNEL_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))   # a Hopper GPU
    implementation = weave_hf._Implementation("weave-test-options", None, 16, per_module, {})
    assert implementation._new_layer(MoESpec(8, 2, 32, 16), torch.device("cuda", 0)) == "layer"
    config = made[0]["config"]
    assert made[0]["backend"] == "weave"
    if per_module:
        assert config == dataclasses.replace(KernelConfig(), interleave_w13=False) and config.resident_at(1)
    else:
        assert config == dataclasses.replace(KernelConfig(), resident="off")
    # a GPU older than the weave backend's kernels need (an A100): the all-to-all baseline instead
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert implementation._new_layer(MoESpec(8, 2, 32, 16), torch.device("cuda", 0)) == "layer"
    assert made[1]["backend"] == "nccl" and "config" not in made[1]

