"""CPU tests of ``VllmGenerationBackend``'s refit/generation guards, on a stand-in for ``vllm.LLM``.

The stand-in records the engine calls and answers nothing else, so these tests pin down the
backend's own rules (which the GPU test ``tests/gpu/test_vllm_fp8_kv.py`` checks on the real
engine): with an FP8 KV cache, an engine never given KV scales does not generate, a refit without
scales is refused and leaves the engine refusing to generate, and a complete refit recovers; an
engine built for vLLM's NCCL weight transfer takes weights only from the trainer's broadcast.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.machinery
import sys
import types

import pytest

from nemo_fp8.generation.config import VllmConfig
from nemo_fp8.generation.interfaces import SamplingParams

DENSE = dict(model_type="qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=512, tie_word_embeddings=False)
MOE = dict(DENSE, model_type="qwen3_moe", moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2)


class _Generated(Exception):
    """Raised by the stand-in engine's ``generate``: the backend's guards let the call through."""


class _FakeLLM:
    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, []
        # vLLM sets the block count once its memory profiling at start has sized the KV cache
        self.llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(
            cache_config=types.SimpleNamespace(num_gpu_blocks=None, block_size=16)))

    def start_weight_update(self, is_checkpoint_format):
        self.calls.append("start")
        self.checkpoint_format = is_checkpoint_format

    def finish_weight_update(self):
        self.calls.append("finish")

    def update_weights(self, request):
        self.calls.append("update")

    def init_weight_transfer_engine(self, request):
        self.calls.append("init")
        self.init_request = request

    answers: dict = {}  # collective_rpc method -> what each worker answers (a test sets it)

    def collective_rpc(self, method, args=()):
        self.calls.append(method)
        return [self.answers[method]] if method in self.answers else []

    def generate(self, *args, **kwargs):
        raise _Generated()


@pytest.fixture
def backend(tmp_path, monkeypatch):
    from transformers import AutoConfig

    from nemo_fp8.generation.vllm import backend as mod
    from nemo_fp8.generation.vllm.engine_args import init_fp8

    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams = _FakeLLM, lambda **kw: kw
    fake.__spec__ = importlib.machinery.ModuleSpec("vllm", None)  # build_generation_backend looks for vLLM
    monkeypatch.setitem(sys.modules, "vllm", fake)
    # no patch-table check against the stand-in, no environment changes in the test process
    monkeypatch.setattr(mod, "init_fp8", functools.partial(init_fp8, apply_env=False, check_patches=False))

    def make(model=DENSE, weight_transfer="ipc", load_initial_weights=False, **cfg):
        AutoConfig.for_model(**model).save_pretrained(str(tmp_path))
        return mod.VllmGenerationBackend(str(tmp_path), VllmConfig(precision="fp8", **cfg), pad_token_id=0,
                                         eos_token_id=1, max_total_sequence_length=64,
                                         load_initial_weights=load_initial_weights, weight_transfer=weight_transfer)

    return make


def _scale_names(num_layers):
    return [f"model.layers.{i}.self_attn.{k}_scale" for i in range(num_layers) for k in "qkv"]


def _refit(be, version, scales):
    """A refit whose tensors the trainer sent itself (``note_sent``); returns ``finish_weight_update()``."""
    be.start_weight_update(version)
    names = sorted(be.plan.expected) + (_scale_names(DENSE["num_hidden_layers"]) if scales else [])
    be.note_sent(names, len(names))
    return be.finish_weight_update()


def test_fp8_kv_engine_generates_only_on_fresh_scales(backend):
    be = backend(kv_cache_dtype="fp8")
    sp = SamplingParams(max_new_tokens=4, greedy=True)
    with pytest.raises(RuntimeError, match="no KV scales were ever loaded"):
        be.generate([[5, 6, 7]], sp)
    v = _refit(be, 1, scales=True)
    assert (v.weights, v.kv_scales) == (1, 1)
    with pytest.raises(_Generated):
        be.generate([[5, 6, 7]], sp)
    with pytest.raises(RuntimeError, match="no KV scales were sent"):
        _refit(be, 2, scales=False)
    assert be.weight_version().weights == 1  # the refused refit is not recorded as held
    with pytest.raises(RuntimeError, match="last refit was refused.*no KV scales were sent"):
        be.generate([[5, 6, 7]], sp)
    # the engine was asked to generate once; the scales the good refit left were read back (restored after a wake)
    assert be.llm.calls == ["start", "finish", "nemo_fp8_attn_scales", "start", "finish"]
    v = _refit(be, 3, scales=True)
    assert (v.weights, v.kv_scales) == (3, 3)
    with pytest.raises(_Generated):
        be.generate([[5, 6, 7]], sp)


def test_incomplete_refit_and_refit_in_progress_block_generation(backend):
    be = backend()  # BF16 KV cache: scales optional
    sp = SamplingParams(max_new_tokens=4, greedy=True)
    assert _refit(be, 1, scales=False).kv_scales == -1
    with pytest.raises(_Generated):
        be.generate([[5, 6, 7]], sp)
    be.start_weight_update(2)
    with pytest.raises(RuntimeError, match="refit to version 2 is in progress"):
        be.generate([[5, 6, 7]], sp)
    be.note_sent(["model.embed_tokens.weight"], 1)
    with pytest.raises(RuntimeError, match="weights did not arrive"):
        be.finish_weight_update()
    with pytest.raises(RuntimeError, match="last refit was refused.*weights did not arrive"):
        be.generate([[5, 6, 7]], sp)
    _refit(be, 3, scales=False)
    with pytest.raises(_Generated):
        be.generate([[5, 6, 7]], sp)


def test_kv_scales_for_only_some_layers_are_refused(backend):
    be = backend(kv_cache_dtype="fp8")
    _refit(be, 1, scales=True)
    be.start_weight_update(2)
    names = sorted(be.plan.expected) + _scale_names(DENSE["num_hidden_layers"])[:-1]  # layer 1's v scale missing
    be.note_sent(names, len(names))
    with pytest.raises(RuntimeError, match=r"KV scales for 5 of 6 .*model\.layers\.1\.self_attn\.v_scale"):
        be.finish_weight_update()
    with pytest.raises(RuntimeError, match="last refit was refused"):
        be.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, greedy=True))


def test_moe_refit_is_complete_with_fused_or_per_expert_expert_names(backend):
    """The trainer may send a layer's experts fused (a transformers-5 model in memory:
    ``experts.gate_up_proj`` / ``down_proj``) or one by one (checkpoints, Megatron-Bridge): both
    complete a refit; an expert name the engine lacks is refused."""
    be = backend(model=MOE)
    fused = sorted(n for n in be.plan.expected if ".experts." not in n) + [
        f"model.layers.{i}.mlp.experts.{k}" for i in range(2) for k in ("gate_up_proj", "down_proj")]
    be.start_weight_update(1)
    be.note_sent(fused, len(fused))
    assert be.finish_weight_update().weights == 1
    be.start_weight_update(2)
    be.note_sent(sorted(be.plan.expected), len(be.plan.expected))  # per expert
    assert be.finish_weight_update().weights == 2
    be.start_weight_update(3)
    with pytest.raises(KeyError, match=r"experts\.4\.up_proj"):
        be.update_weights([("model.layers.0.mlp.experts.4.up_proj.weight", None)])


def test_tensor_parallel_engine_refits_every_gpu_and_refuses_a_one_gpu_sender(backend, monkeypatch):
    """An engine of two GPUs: ``update_weights`` hands ``send_weights_ipc`` the workers' devices (cuda:0, cuda:1),
    so every worker gets a copy on its own GPU; a trainer's direct CUDA IPC refit (one GPU's handles) is refused.
    A one-GPU engine passes no devices: vLLM's own IPC sender, as before."""
    import torch

    from nemo_fp8.generation.vllm import backend as mod

    sent = []
    monkeypatch.setattr(mod, "send_weights_ipc", lambda items, fn, plan, bucket_bytes, devices=None, layout=None,
                        packed=False, packer=None: sent.append((len(items), devices)) or len(items))
    be = backend(tensor_parallel_size=2)
    assert be.llm.kwargs["tensor_parallel_size"] == 2 and be.llm.kwargs["distributed_executor_backend"] == "mp"
    be.start_weight_update(1)
    be.update_weights([("model.embed_tokens.weight", None)])
    assert sent == [(1, [torch.device("cuda", 0), torch.device("cuda", 1)])]
    with pytest.raises(RuntimeError, match="tensor_parallel_size=2.*'object_store' or 'auto'"):
        be.direct_refit_spec()
    one = backend()
    one.start_weight_update(1)
    one.update_weights([("model.embed_tokens.weight", None)])
    assert sent[-1] == (1, None) and set(one.direct_refit_spec()) == {"plan", "skip", "layout"}


def test_an_engine_never_refit_does_not_generate(backend):
    """The engine starts on dummy weights (``load_format="dummy"``): without a refit it must not roll out."""
    be = backend()  # load_initial_weights=False
    with pytest.raises(RuntimeError, match=r"no policy weights yet \(dummy weights until the first refit\)"):
        be.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, greedy=True))
    assert be.llm.calls == []


def test_nccl_engine_takes_weights_only_from_the_trainers_broadcast(backend):
    """``weight_transfer="nccl"``: vLLM's NCCL weight-transfer engine. No initial load (it would go over CUDA IPC),
    no tensors through ``update_weights``; its workers join the trainer's group as ranks 1..n; the trainer's first
    refit (version 0: names through ``receive_update`` while the trainer broadcasts, then ``note_sent``) is what
    lets it generate; shutdown aborts the workers' communicators. The broadcast itself needs two GPUs
    (``tests/gpu/test_weight_sync_nccl.py``)."""
    import torch

    be = backend(weight_transfer="nccl", load_initial_weights=True)
    llm = be.llm
    assert llm.kwargs["weight_transfer_config"] == {"backend": "nccl"}
    assert llm.calls == [] and be.weight_version().weights == -1  # nothing loaded at start
    sp = SamplingParams(max_new_tokens=4, greedy=True)
    with pytest.raises(RuntimeError, match="no policy weights yet.*the trainer's first refit over NCCL"):
        be.generate([[5, 6, 7]], sp)
    # one group over every engine's workers: engine 1 of two one-GPU engines is rank 2 of 3; rank 3 is outside
    with pytest.raises(ValueError, match=r"world_size=3, rank_offset=3, .* 1 per engine: this engine's ranks 3..3 "
                                         r"must lie in 1..2"):
        be.init_weight_transfer("10.0.0.1", 29500, 3, rank_offset=3)
    with pytest.raises(ValueError, match=r"rank_offset=0"):
        be.init_weight_transfer("10.0.0.1", 29500, 2, rank_offset=0)
    be.init_weight_transfer("10.0.0.1", 29500, 2)
    assert llm.init_request == {"init_info": {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1,
                                              "world_size": 2}}
    with pytest.raises(RuntimeError, match="joined an NCCL group already"):
        be.init_weight_transfer("10.0.0.1", 29500, 2)
    be.start_weight_update(0)
    with pytest.raises(RuntimeError, match="NCCL weight transfer.*only by NCCL broadcast from the trainer"):
        be.update_weights([("model.embed_tokens.weight", torch.zeros(512, 256))])
    spec = be.direct_refit_spec()
    names = sorted(spec["plan"].expected)
    be.receive_update({"update_info": {"names": names, "dtype_names": ["bfloat16"] * len(names),
                                       "shapes": [[1]] * len(names), "packed": True}})
    be.note_sent(names, len(names))
    assert be.finish_weight_update().weights == 0
    with pytest.raises(_Generated):
        be.generate([[5, 6, 7]], sp)
    assert llm.calls == ["init", "start", "update", "finish"]
    be.shutdown()
    assert llm.calls[-1] == "nemo_fp8_close_weight_transfer"


def test_nccl_engine_of_two_gpus_answers_the_trainer_and_ipc_engines_join_no_group(backend):
    """The broadcast reaches every worker, so a tensor-parallel NCCL engine gives the trainer its refit spec (a
    CUDA IPC engine of two GPUs refuses it: ``test_tensor_parallel_engine_refits_every_gpu...``); its group has the
    trainer plus two workers. A CUDA IPC engine refuses to join an NCCL group and shuts down without one."""
    tp2 = backend(weight_transfer="nccl", tensor_parallel_size=2)
    assert set(tp2.direct_refit_spec()) == {"plan", "skip", "layout"}
    tp2.init_weight_transfer("10.0.0.1", 29500, 3)
    assert tp2.llm.init_request["init_info"]["world_size"] == 3
    ipc = backend()
    with pytest.raises(RuntimeError, match="IPC weight transfer; an NCCL group needs weight_transfer='nccl'"):
        ipc.init_weight_transfer("10.0.0.1", 29500, 2)
    llm = ipc.llm
    ipc.shutdown()
    assert "nemo_fp8_close_weight_transfer" not in llm.calls


def test_trainer_builds_an_nccl_engine_for_weight_sync_nccl(backend, tmp_path):
    """``start_workers``' engine spec (``generation_spec``, a frozen ``GenerationSpec``) through
    ``build_generation_backend``: ``policy.weight_sync.method=nccl`` gives the engine vLLM's NCCL weight transfer and no sleep mode (GPUs of its
    own); the default keeps IPC."""
    from nemo_fp8.config import load_config
    from nemo_fp8.generation import build_generation_backend
    from nemo_fp8.trainer import generation_spec

    backend()  # the stand-in vLLM module and the model's config.json in tmp_path
    tok = types.SimpleNamespace(pad_token_id=0, eos_token_id=1)
    base = ["policy.tiny_model.build_if_missing=false", f"policy.model_name={tmp_path}"]
    cfg = load_config("examples/configs/grpo_math_tiny_megatron_fp8.yaml",
                      [*base, "policy.weight_sync.method=nccl", "policy.generation.colocated.enabled=false"])
    spec = generation_spec(cfg, tok, device=None)
    assert spec.weight_transfer == "nccl" and spec.offload_when_idle is False
    with pytest.raises(dataclasses.FrozenInstanceError):  # one spec, read by every engine: nobody edits it
        spec.weight_transfer = "ipc"
    be = build_generation_backend(spec)
    assert be.llm.kwargs["weight_transfer_config"] == {"backend": "nccl"} and not be.llm.kwargs["enable_sleep_mode"]
    assert be.llm.calls == [] and be.weight_transfer == "nccl"  # no initial load
    ipc = generation_spec(load_config("examples/configs/grpo_math_tiny_megatron_fp8.yaml", base), tok, None)
    assert ipc.weight_transfer == "ipc"
    torch_engine = load_config("examples/configs/grpo_math_tiny_fp8.yaml", base)  # the torch engine takes no such key
    assert generation_spec(torch_engine, tok, None).weight_transfer is None


def test_sampled_requests_carry_seeds_unless_seed_each_request_is_off(backend):
    """``vllm_cfg.seed_each_request`` (default): every sampled request has its own seed (``request_seed``), so a
    prompt's samples do not depend on the engine or batch; off: no request has one (vLLM draws the batch's noise
    at once from the engine's generator); greedy requests never have one."""
    from nemo_fp8.generation.interfaces import request_seed

    def seeds(be, sampling, **kw):
        sent = []

        def record(prompts, params, use_tqdm=False):
            sent.extend(params)
            raise _Generated()

        be.llm.generate = record
        with pytest.raises(_Generated):
            be.generate([[5, 6, 7], [8, 9]], sampling, **kw)
        return [p["seed"] for p in sent]

    sampled = SamplingParams(max_new_tokens=4, seed=11)
    be = backend()
    _refit(be, 0, scales=False)
    assert seeds(be, sampled) == [request_seed(11, 0), request_seed(11, 1)]
    assert seeds(be, sampled, request_seeds=[3, 4]) == [3, 4]  # the group's seeds for the prompts it sent here
    assert seeds(be, SamplingParams(max_new_tokens=4, greedy=True)) == [None, None]
    batch_seeded = backend(seed_each_request=False)
    _refit(batch_seeded, 0, scales=False)
    assert seeds(batch_seeded, sampled, request_seeds=[3, 4]) == [None, None]


def test_the_engine_reports_its_kv_capacity_in_tokens_every_step(backend):
    """``generation/kv_capacity_tokens``: vLLM's block count x block size, the same every step (a step's generation
    rounds keep it, not sum it); a group of engines reports their sum once every engine has one; none before vLLM
    has sized its cache, and none from the torch engine."""
    from nemo_fp8.algorithms.grpo import sum_engine_metrics
    from nemo_fp8.generation.group import GenerationGroup

    be = backend()
    assert be.pop_engine_metrics() == {"generation/engines": 1.0}  # no block count yet
    be.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks = 11_347
    m = be.pop_engine_metrics()
    assert m == {"generation/engines": 1.0, "generation/kv_capacity_tokens": 181_552.0}
    assert be.pop_engine_metrics() == m  # nothing to reset: the cache keeps its size
    rounds = [{**m, "generation/engine_0/tokens": 10.0}, {**m, "generation/engine_0/tokens": 5.0}]
    summed = sum_engine_metrics(rounds)
    assert summed["generation/kv_capacity_tokens"] == 181_552.0 and summed["generation/engine_0/tokens"] == 15.0
    group = GenerationGroup([object(), object()])
    assert "generation/kv_capacity_tokens" not in group.pop_engine_metrics()  # built without start: unknown
    group.kv_capacity_tokens = [181_552.0, 363_104.0]
    assert group.pop_engine_metrics()["generation/kv_capacity_tokens"] == 544_656.0
    group.kv_capacity_tokens = [181_552.0, None]  # one engine without a KV cache size: no total
    assert "generation/kv_capacity_tokens" not in group.pop_engine_metrics()


class _ScaleResettingLLM(_FakeLLM):
    """The stand-in with attention scales: a refit with KV scales writes them; waking the KV cache resets k and v
    to 1.0, as vLLM 0.22's V1 runner does for an FP8 KV cache (``GPUModelRunner.init_fp8_kv_scales``)."""

    restores = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.scales = {f"model.layers.{i}.self_attn.attn": {"q": 1.0, "k": 1.0, "v": 1.0} for i in range(2)}

    def finish_weight_update(self):
        super().finish_weight_update()
        for i, rec in enumerate(self.scales.values()):
            rec.update(q=0.5 + i, k=0.25 + i, v=0.125 + i)  # what the refit's scales wrote

    def sleep(self, level):
        self.calls.append(f"sleep{level}")

    def wake_up(self, tags):
        self.calls.append(f"wake:{','.join(tags)}")
        if "kv_cache" in tags:
            for rec in self.scales.values():
                rec.update(k=1.0, v=1.0)

    def collective_rpc(self, method, args=()):
        self.calls.append(method)
        if method == "nemo_fp8_attn_scales":
            return [{n: dict(r) for n, r in self.scales.items()}]
        if method == "nemo_fp8_restore_kv_scales" and self.restores:
            for n, rec in args[0].items():
                self.scales[n].update(rec)
        return [len(args[0])] if args else []


def test_fp8_kv_scales_survive_the_kv_caches_wake(backend):
    """vLLM resets k/v scales to 1.0 when an FP8 KV cache wakes: the backend puts the last refit's back and checks
    them live; an engine that keeps the reset is refused before it generates."""
    be = backend(kv_cache_dtype="fp8")
    be.llm = _ScaleResettingLLM()
    be.spec.engine_kwargs["enable_sleep_mode"] = True  # colocated
    _refit(be, 1, scales=True)
    refit_scales = {n: dict(r) for n, r in be.llm.scales.items()}
    be.finish_generation()
    be.prepare_for_generation()
    assert be.llm.scales == refit_scales and be.llm.calls[-4:] == [
        "sleep1", "wake:kv_cache,weights", "nemo_fp8_restore_kv_scales", "nemo_fp8_attn_scales"]
    with pytest.raises(_Generated):
        be.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, greedy=True))
    be.llm.restores = False  # the reset sticks
    be.finish_generation()
    with pytest.raises(RuntimeError, match="after the engine's wake, model.layers.0.self_attn.attn .* reads scales"):
        be.prepare_for_generation()


def test_a_kernel_format_engine_copies_its_refits_into_its_own_parameters(backend, monkeypatch):
    """vllm_cfg.refit_format: kernel: the engine reads its parameters from its worker, checks that a refit of its
    checkpoint covers them, starts every refit in vLLM's kernel format and hands the layout to whoever sends
    (its own update_weights, a trainer's direct refit); an FP8 engine on DeepGEMM is refused at start."""
    from nemo_fp8.generation.vllm import backend as mod
    from nemo_fp8.generation.vllm.kernel_format import KernelLayout
    from nemo_fp8.generation.vllm.refit import meta_model
    from tests.generation.test_vllm_kernel_format import PACKED, QWEN3, _engine_params

    be0 = backend(model=QWEN3)  # the plan of this model, for the parameter table its worker would report
    table = _engine_params(meta_model(QWEN3), be0.plan)
    answer = {"params": table, "packed": PACKED, "linear_kernels": ["CutlassFp8BlockScaledMMKernel"]}
    monkeypatch.setattr(_FakeLLM, "answers", {"nemo_fp8_kernel_params": answer})
    sent = []
    monkeypatch.setattr(mod, "send_weights_ipc", lambda items, fn, plan, bucket_bytes, devices=None, layout=None,
                        packed=False, packer=None: sent.append(layout) or len(items))
    be = backend(model=QWEN3, refit_format="kernel")
    assert isinstance(be.kernel_layout, KernelLayout) and be.kernel_layout.params == table
    assert be.llm.calls.index("nemo_fp8_kernel_params") < be.llm.calls.index("nemo_fp8_freeze_params")
    be.start_weight_update(1)
    assert be.llm.checkpoint_format is False
    be.update_weights([("model.embed_tokens.weight", None)])
    assert sent == [be.kernel_layout] and be.direct_refit_spec()["layout"] is be.kernel_layout
    assert backend(model=QWEN3).direct_refit_spec()["layout"] is None  # the checkpoint format: no layout
    monkeypatch.setattr(_FakeLLM, "answers", {"nemo_fp8_kernel_params": dict(
        answer, linear_kernels=["DeepGemmFp8BlockScaledMMKernel"])})
    with pytest.raises(RuntimeError, match="CUTLASS's block-scaled kernel, this engine runs "
                                           "\\['DeepGemmFp8BlockScaledMMKernel'\\]"):
        backend(model=QWEN3, refit_format="kernel")
