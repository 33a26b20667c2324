"""CPU tests of ``SglangGenerationBackend`` on a stand-in for SGLang 0.5.17.

The stand-in implements the few SGLang pieces the backend touches with the behaviour read in SGLang's source: the
``Engine`` (``release_memory_occupation`` / ``resume_memory_occupation``, ``flush_cache``, ``generate``'s output
dicts), its tokenizer manager's ``update_weights_from_tensor`` (a flattened bucket loaded as
``FlattenedTensorBucket.reconstruct_tensors`` rebuilds it; the request's ``weight_version`` recorded on success and
stamped on later outputs), ``MultiprocessingSerializer`` (plain pickle on CPU tensors). The backend's own code runs
unchanged: the refit's conversion (the project's quantizer), flattened packing, the transport's requests, the
completeness and KV-scale checks, colocation and the output checks. The GPU tests (``tests/gpu/test_sglang_fp8.py``)
check the same rules on the real engine.
"""

from __future__ import annotations

import asyncio
import pickle
import sys
import types
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from nemo_fp8.fp8 import quantize_weight_blockwise
from nemo_fp8.fp8.kv_scales import KvScales
from nemo_fp8.generation.config import VllmConfig
from nemo_fp8.generation.interfaces import SamplingParams, WeightVersion
from nemo_fp8.generation.sglang.config import SglangConfig
from nemo_fp8.generation.sglang.engine_args import SYNC_HOOK

DENSE = dict(model_type="qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=512, tie_word_embeddings=False)
GREEDY = SamplingParams(max_new_tokens=4, greedy=True)


@dataclass
class _Meta:  # the fields of SGLang's FlattenedTensorMetadata
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass
class _UpdateReq:  # the fields of SGLang's UpdateWeightsFromTensorReqInput the backend sets
    serialized_named_tensors: list
    load_format: Optional[str] = None
    flush_cache: bool = True
    weight_version: Optional[str] = None


class _TokenizerManager:
    def __init__(self, engine):
        self.engine = engine

    async def update_weights_from_tensor(self, obj, request):
        e = self.engine
        e.requests.append((obj.load_format, obj.weight_version))
        data = pickle.loads(obj.serialized_named_tensors[0])
        if e.fail or (e.fail_tag and obj.weight_version is not None):
            return False, "the scheduler raised"
        if obj.load_format == "flattened_bucket":  # FlattenedTensorBucket.reconstruct_tensors, then load_weights
            for m in data["metadata"]:
                e.params[m.name] = data["flattened_tensor"][m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape).clone()
        elif obj.load_format == SYNC_HOOK:
            assert data == []
        if obj.weight_version is not None:
            e.version = obj.weight_version
        return True, "Success"


class _Engine:
    def __init__(self, **kwargs):
        self.kwargs, self.version = kwargs, kwargs["weight_version"]
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = _TokenizerManager(self)
        self.params, self.requests, self.calls, self.fail, self.fail_tag = {}, [], [], False, False

    def release_memory_occupation(self, tags):
        self.calls.append(("release", tuple(tags)))

    def resume_memory_occupation(self, tags):
        self.calls.append(("resume", tuple(tags)))

    def flush_cache(self):
        self.calls.append("flush")

    def generate(self, input_ids, sampling_params, return_logprob):
        self.calls.append("generate")
        assert return_logprob and len(sampling_params) == len(input_ids)
        return [{"output_ids": [5, 1], "meta_info": {"output_token_logprobs": [(-0.25, 5, None), (-0.5, 1, None)],
                                                     "finish_reason": {"type": "stop"},
                                                     "weight_version": self.version}} for _ in input_ids]

    def get_server_info(self):  # Engine.get_server_info: the server args and the first scheduler's init info
        self.calls.append("server_info")
        return {"max_total_num_tokens": 229_872, "context_length": 1024}

    def shutdown(self):
        self.calls.append("shutdown")


def _install_fake_sglang(monkeypatch):
    mods = {name: types.ModuleType(name) for name in (
        "sglang", "sglang.srt", "sglang.srt.entrypoints", "sglang.srt.entrypoints.engine", "sglang.srt.utils",
        "sglang.srt.utils.patch_torch", "sglang.srt.weight_sync", "sglang.srt.weight_sync.tensor_bucket",
        "sglang.srt.managers", "sglang.srt.managers.io_struct")}
    mods["sglang.srt.entrypoints.engine"].Engine = _Engine
    mods["sglang.srt.utils"].MultiprocessingSerializer = types.SimpleNamespace(serialize=pickle.dumps)
    mods["sglang.srt.utils.patch_torch"].monkey_patch_torch_reductions = lambda: None
    mods["sglang.srt.weight_sync.tensor_bucket"].FlattenedTensorMetadata = _Meta
    mods["sglang.srt.managers.io_struct"].UpdateWeightsFromTensorReqInput = _UpdateReq
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**DENSE), dtype=torch.bfloat16).save_pretrained(str(path))
    return path


@pytest.fixture
def make(checkpoint, monkeypatch):
    _install_fake_sglang(monkeypatch)
    from nemo_fp8.generation.sglang.backend import SglangGenerationBackend

    def build(sglang_cfg=None, colocated=False, bucket_bytes=1 << 30, **cfg):
        return SglangGenerationBackend(str(checkpoint), VllmConfig(precision="fp8", **cfg), sglang_cfg or SglangConfig(),
                                       pad_token_id=0, eos_token_id=1, max_total_sequence_length=64,
                                       colocated=colocated, bucket_bytes=bucket_bytes, device=torch.device("cpu"))

    return build


def _state(checkpoint) -> dict[str, torch.Tensor]:
    from nemo_fp8.models.hf import iter_checkpoint

    return dict(iter_checkpoint(str(checkpoint)))


def _scales(step, num_layers=3, value=0.05) -> KvScales:
    amax = torch.full((num_layers,), value * 448.0)
    return KvScales.from_amax(amax, amax * 2, amax * 4, step)


def test_initial_load_sends_the_checkpoint_quantized_in_flattened_buckets(make, checkpoint):
    be = make(num_last_layers_in_bf16=1, bucket_bytes=200_000)
    got, state = be.engine.params, _state(checkpoint)
    q, s = quantize_weight_blockwise(state["model.layers.0.self_attn.k_proj.weight"], scale_mode="fp32")
    assert got["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(got["model.layers.0.self_attn.k_proj.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got["model.layers.0.self_attn.k_proj.weight_scale_inv"], s)
    # num_last_layers_in_bf16=1: layer 2 and the norms arrive as the checkpoint's bf16, no scales
    assert torch.equal(got["model.layers.2.mlp.down_proj.weight"], state["model.layers.2.mlp.down_proj.weight"])
    assert "model.layers.2.mlp.down_proj.weight_scale_inv" not in got
    assert torch.equal(got["model.norm.weight"], state["model.norm.weight"])
    fp8 = set(be.spec.fp8_modules)
    assert set(got) == set(state) | {f"{m}.weight_scale_inv" for m in fp8}
    formats = [f for f, _ in be.engine.requests]
    assert formats[:-1] == ["flattened_bucket", SYNC_HOOK] * (len(formats) // 2) and len(formats) > 3  # buckets
    assert be.engine.requests[-1] == (SYNC_HOOK, "0") and be.engine.version == "0"  # the version tag comes last
    assert be.weight_version() == WeightVersion(weights=0, kv_scales=-1, num_tensors=len(got))


def test_generate_flushes_the_prefix_cache_once_per_refit_and_checks_the_version(make, checkpoint):
    be = make()
    out = be.generate([[7, 8], [9]], GREEDY)
    assert out.token_ids.tolist() == [[7, 8, 5, 1], [9, 5, 1, 0]] and out.truncated.tolist() == [False, False]
    be.generate([[7]], GREEDY)
    assert be.engine.calls == ["flush", "generate", "generate"]
    be.engine.version = "7"  # an engine that holds another version than the backend set
    with pytest.raises(RuntimeError, match="served by weights of version '7', the engine should hold '0'"):
        be.generate([[7]], GREEDY)


def test_the_engine_reports_its_kv_capacity_in_tokens(make):
    """``generation/kv_capacity_tokens`` every round, SGLang's ``max_total_num_tokens`` read once from
    ``get_server_info``; an engine that does not report it adds nothing."""
    be = make()
    for _ in range(2):
        assert be.pop_engine_metrics() == {"generation/engines": 1.0, "generation/kv_capacity_tokens": 229_872.0}
    assert be.engine.calls.count("server_info") == 1
    quiet = make()
    quiet.engine.get_server_info = lambda: {}
    assert quiet.pop_engine_metrics() == {"generation/engines": 1.0}


def test_fp8_kv_cache_refits_carry_k_and_v_scales(make, checkpoint):
    be = make(kv_cache_dtype="fp8")
    with pytest.raises(RuntimeError, match="no KV scales were ever loaded"):
        be.generate([[7]], GREEDY)
    state = _state(checkpoint)
    be.start_weight_update(1)
    be.update_weights(state.items())
    with pytest.raises(RuntimeError, match="refit to version 1: kv_cache_dtype='fp8' but no KV scales"):
        be.finish_weight_update()
    with pytest.raises(RuntimeError, match="the last refit was refused"):
        be.generate([[7]], GREEDY)
    scales = _scales(2)
    be.start_weight_update(2)
    be.update_weights(list(state.items()) + list(scales.named_tensors()))
    assert be.finish_weight_update() == be.weight_version() and be.weight_version().kv_scales == 2
    got = be.engine.params
    assert not any(n.endswith("q_scale") for n in got)  # SGLang has no q scale
    for i in range(3):
        assert got[f"model.layers.{i}.self_attn.k_scale"].dim() == 0
        assert float(got[f"model.layers.{i}.self_attn.k_scale"]) == float(scales.k_scale[i])
        assert float(got[f"model.layers.{i}.self_attn.v_scale"]) == float(scales.v_scale[i])
    be.generate([[7]], GREEDY)
    be.start_weight_update(3)  # scales of some layers only
    be.update_weights(list(state.items()) + [(n, t) for n, t in scales.named_tensors() if ".layers.0." not in n])
    with pytest.raises(RuntimeError, match=r"KV scales for 4 of 6 \(layer, k/v\) pairs"):
        be.finish_weight_update()


@pytest.mark.parametrize("bad", ["zero_scale", "unknown_name"])
def test_a_bad_bucket_is_refused_before_anything_is_sent(make, checkpoint, bad):
    be = make(kv_cache_dtype="fp8")
    state = _state(checkpoint)
    sent = len(be.engine.requests)
    be.start_weight_update(1)
    if bad == "zero_scale":
        items = list(state.items()) + [(n, torch.tensor(0.0) if n.endswith("layers.1.self_attn.v_scale") else t)
                                       for n, t in _scales(1).named_tensors()]
        with pytest.raises(ValueError, match="KV scale model.layers.1.self_attn.v_scale = 0.0"):
            be.update_weights(items)
    else:
        with pytest.raises(KeyError, match="no weight 'model.layers.0.mlp.nope.weight'"):
            be.update_weights(list(state.items()) + [("model.layers.0.mlp.nope.weight", torch.zeros(2, 2))])
    assert len(be.engine.requests) == sent  # nothing of the bucket reached the engine
    with pytest.raises(RuntimeError, match="the last refit was refused"):
        be.generate([[7]], GREEDY)
    be.start_weight_update(2)  # the refused refit is over: a new one starts and recovers the engine
    be.update_weights(list(state.items()) + list(_scales(2).named_tensors()))
    assert be.finish_weight_update().weights == 2
    be.generate([[7]], GREEDY)


def test_missing_weights_or_an_engine_failure_refuse_the_refit(make, checkpoint):
    be = make()
    state = _state(checkpoint)
    be.start_weight_update(1)
    be.update_weights([(n, t) for n, t in state.items() if n != "model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(RuntimeError, match=r"1 weights did not arrive \(e.g. \['model.layers.1.mlp.up_proj.weight'\]"):
        be.finish_weight_update()
    assert be.weight_version().weights == 0 and be.engine.version == "0"  # not tagged with the refused version
    be.engine.fail = True
    be.start_weight_update(2)
    with pytest.raises(RuntimeError, match="update_weights_from_tensor .* failed: the scheduler raised"):
        be.update_weights(state.items())
    with pytest.raises(RuntimeError, match="refit to version 2: SGLang update_weights_from_tensor"):
        be.generate([[7]], GREEDY)
    with pytest.raises(RuntimeError, match="update_weights before start_weight_update"):
        be.update_weights(state.items())
    be.engine.fail, be.engine.fail_tag = False, True  # the weights load, the version tag fails
    be.start_weight_update(3)
    be.update_weights(state.items())
    with pytest.raises(RuntimeError, match="failed: the scheduler raised"):
        be.finish_weight_update()
    with pytest.raises(RuntimeError, match="refit to version 3: tagging the engine failed"):
        be.generate([[7]], GREEDY)


def test_colocated_release_discards_the_weights_until_a_refit(make, checkpoint):
    be = make(colocated=True)
    assert be.spec.engine_kwargs["enable_memory_saver"]
    be.generate([[7]], GREEDY)
    be.finish_generation()
    be.finish_generation()  # released already: nothing more
    assert be.engine.calls[-1] == ("release", ("kv_cache", "weights", "cuda_graph"))
    assert be.weight_version() == WeightVersion(-1, -1, 0)
    with pytest.raises(RuntimeError, match="discarded its weights .* refit before waking"):
        be.prepare_for_generation()
    with pytest.raises(RuntimeError, match="memory is released"):
        be.generate([[7]], GREEDY)
    be.start_weight_update(1)
    assert be.engine.calls[-1] == ("resume", ("weights",))  # the refit brings the weights' memory back first
    be.update_weights(_state(checkpoint).items())
    be.finish_weight_update()
    be.prepare_for_generation()
    assert be.engine.calls[-1] == ("resume", ("cuda_graph", "kv_cache"))
    assert be.generate([[7]], GREEDY).response_lengths.tolist() == [2]


def test_cpu_weight_backup_keeps_the_version_across_a_release(make):
    be = make(sglang_cfg=SglangConfig(cpu_weight_backup=True), colocated=True)
    assert be.spec.engine_kwargs["enable_weights_cpu_backup"]
    be.finish_generation()
    assert be.weight_version().weights == 0
    be.prepare_for_generation()
    assert be.engine.calls[-1] == ("resume", ("cuda_graph", "kv_cache", "weights"))
    be.generate([[7]], GREEDY)
    be.shutdown()
    be.shutdown()  # idempotent


def test_build_generation_backend_without_sglang_names_the_extra():
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here")
    from nemo_fp8.generation import GenerationSpec, build_generation_backend

    spec = GenerationSpec(backend="sglang", model_name="/m", vllm_cfg=VllmConfig(), device=None, pad_token_id=0,
                          eos_token_id=1, max_total_sequence_length=64)
    with pytest.raises(ImportError, match="needs SGLang 0.5.17 \\(pyproject extra 'sglang'"):
        build_generation_backend(spec)


def test_the_config_reaches_the_engine_through_the_spec(make, checkpoint):
    """``policy.generation.sglang_cfg`` travels in the ``GenerationSpec`` the engine actors get
    (``trainer.generation_spec``) and ``build_generation_backend`` builds the SGLang engine from it."""
    import importlib.machinery

    from nemo_fp8.config import load_config
    from nemo_fp8.generation import build_generation_backend
    from nemo_fp8.trainer import generation_spec

    sys.modules["sglang"].__spec__ = importlib.machinery.ModuleSpec("sglang", None)  # build_generation_backend looks
    cfg = load_config("examples/configs/grpo_math_tiny_fp8.yaml", [
        "policy.tiny_model.build_if_missing=false", f"policy.model_name={checkpoint}", "policy.generation.backend=sglang",
        "policy.generation.sglang_cfg.mem_fraction_static=0.3", "policy.generation.sglang_cfg.random_seed=5"])
    spec = generation_spec(cfg, types.SimpleNamespace(pad_token_id=0, eos_token_id=1), torch.device("cpu"))
    assert spec.backend == "sglang" and spec.sglang_cfg.mem_fraction_static == 0.3 and spec.weight_transfer is None
    be = build_generation_backend(spec)
    kw = be.engine.kwargs
    assert kw["mem_fraction_static"] == 0.3 and kw["random_seed"] == 5 and kw["enable_memory_saver"]
    assert kw["model_path"] == str(checkpoint) and kw["context_length"] == cfg.policy.max_total_sequence_length
    assert be.weight_version().weights == 0 and be.engine.version == "0"  # the initial load ran
