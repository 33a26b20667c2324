"""Weight sync in one process: buckets, packing, versions, FP8 KV scales, completeness; the transports' choice
and the NCCL refit's driver side (stand-in actors)."""

import types

import pytest
import torch

from nemo_fp8.distributed.weight_sync import (InProcessWeightSync, iter_buckets, pack_bucket, unpack_bucket,
                                              weight_stream)
from nemo_fp8.fp8 import Fp8BlockLinear
from nemo_fp8.fp8.kv_scales import KvScales, fake_quantize_static, is_kv_scale_name, parse_kv_scale_name
from nemo_fp8.fp8.quantize import quantize_weight_blockwise
from nemo_fp8.generation import SamplingParams
from nemo_fp8.generation.torch_backend import TorchGenerationBackend
from nemo_fp8.policy.torch_backend import TorchPolicyBackend
from nemo_fp8.policy.spec import PolicySpec

CPU = torch.device("cpu")


def test_buckets_respect_the_size_and_keep_order():
    ts = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    buckets = list(iter_buckets(iter(ts), bucket_bytes=100))  # 100 bytes = 25 floats
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]
    assert all(b[0][1].data_ptr() == dict(ts)[b[0][0]].data_ptr() for b in buckets)  # views, no copies
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets(iter(ts), 0))


def test_pack_unpack_round_trip_every_dtype():
    items = [("a", torch.randn(3, 5, dtype=torch.bfloat16)), ("b", torch.randn(7)),
             ("c", torch.tensor(0.25)), ("d", torch.randn(4, 4).to(torch.float8_e4m3fn)),
             ("e", torch.arange(5)), ("f", torch.randn(2, 3, dtype=torch.float16).t())]  # non-contiguous
    packed = pack_bucket(items)
    assert all(off % 16 == 0 for off in packed.offsets)
    back = unpack_bucket(packed)
    assert [n for n, _ in back] == [n for n, _ in items]
    for (_, x), (_, y) in zip(items, back):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                           y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y)


def test_kv_scales_from_amax_and_names():
    s = KvScales.from_amax(torch.tensor([448.0, 0.0]), torch.tensor([224.0, 1.0]), torch.tensor([4.48, 2.0]),
                           step=3, margin=2.0)
    assert s.q_scale.tolist() == [2.0, pytest.approx(1e-12 * 2 / 448)]  # zero amax still gets a positive scale
    assert s.k_scale[0] == 1.0 and s.v_scale[0] == pytest.approx(0.02)
    names = [n for n, _ in s.named_tensors()]
    assert names[:3] == ["model.layers.0.self_attn.q_scale", "model.layers.0.self_attn.k_scale",
                         "model.layers.0.self_attn.v_scale"] and len(names) == 6
    assert all(is_kv_scale_name(n) for n in names) and parse_kv_scale_name(names[4]) == (1, "k")
    assert not is_kv_scale_name("model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(ValueError, match="margin"):
        KvScales.from_amax(torch.ones(2), torch.ones(2), torch.ones(2), step=0, margin=0.5)
    with pytest.raises(ValueError, match="v_amax"):
        KvScales.from_amax(torch.ones(2), torch.ones(2), torch.tensor([1.0, float("nan")]), step=0)


def _engine(cfg, tok, precision):
    vc = cfg.policy.generation.vllm_cfg.model_copy(update={"precision": precision})
    return TorchGenerationBackend(cfg.policy.model_name, vc, CPU, tok.pad_token_id, tok.eos_token_id,
                                  cfg.policy.max_total_sequence_length, batch_size=8)


@pytest.mark.parametrize("precision", ["bfloat16", "fp8"])
def test_in_process_sync_loads_every_weight_with_its_version(tiny_cfg, tok, precision):
    cfg = tiny_cfg()
    policy = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # weights the engine has not seen
    gen = _engine(cfg, tok, precision)
    stats = InProcessWeightSync(policy, gen, bucket_bytes=256 * 1024).sync(version=7)
    assert stats.num_buckets > 1 and stats.max_bucket_bytes <= max(256 * 1024, max(
        t.numel() * t.element_size() for _, t in policy.named_weights()))
    assert gen.weight_version().weights == 7 and gen.weight_version().kv_scales == -1
    want = dict(policy.named_weights())
    q = gen.model.model.layers[1].self_attn.q_proj
    if precision == "fp8":  # FP8 layers quantized on arrival, bit for bit as the reference quantizer
        assert isinstance(q, Fp8BlockLinear)
        wq, sinv = quantize_weight_blockwise(want["model.layers.1.self_attn.q_proj.weight"], (128, 128))
        assert torch.equal(q.weight.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(q.weight_scale_inv, sinv)
    else:
        assert torch.equal(q.weight, want["model.layers.1.self_attn.q_proj.weight"].to(torch.bfloat16))


def test_sync_stats_split_the_update_into_frame_export_and_load(tiny_cfg, tok):
    """SyncStats.parts: the engine's start and finish, its loads per bucket and the rest (the export) add up to
    the update's wall time; a transport that did not time its loads gives no parts (export would swallow them)."""
    from nemo_fp8.distributed.weight_sync import SyncStats

    cfg = tiny_cfg()
    policy = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))
    stats = InProcessWeightSync(policy, _engine(cfg, tok, "fp8"), bucket_bytes=256 * 1024).sync(version=1)
    parts = stats.parts()
    assert list(parts) == ["start", "export", "load", "finish"] and all(v >= 0 for v in parts.values())
    assert parts["load"] > 0 and sum(parts.values()) == pytest.approx(stats.seconds)
    untimed = SyncStats(2, seconds=1.0, start_seconds=0.1, finish_seconds=0.2)
    untimed.add_bucket(3, 300)
    assert untimed.parts() == {}
    timed = SyncStats(2, seconds=1.0, start_seconds=0.1, finish_seconds=0.2)
    timed.add_bucket(3, 300, 0.25)
    timed.add_bucket(1, 100, 0.25)
    assert timed.parts() == pytest.approx({"start": 0.1, "export": 0.2, "load": 0.5, "finish": 0.2})


def test_kv_scales_travel_with_the_weights_and_incomplete_updates_fail(tiny_cfg, tok):
    cfg = tiny_cfg()
    policy = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))
    gen = _engine(cfg, tok, "fp8")
    n = gen.num_layers
    scales = KvScales.from_amax(torch.arange(1.0, n + 1), torch.ones(n), 2 * torch.ones(n), step=4)
    InProcessWeightSync(policy, gen, bucket_bytes=2**20).sync(version=4, kv_scales=scales)
    assert gen.weight_version().kv_scales == 4
    torch.testing.assert_close(gen.kv_scales["q"], scales.q_scale)
    # An update that misses weights would leave the engine on two versions: refused.
    gen.start_weight_update(5)
    gen.update_weights(list(policy.named_weights())[:3])
    with pytest.raises(RuntimeError, match="did not arrive"):
        gen.finish_weight_update()
    # Scales for only some layers: refused too.
    gen.start_weight_update(6)
    gen.update_weights(weight_stream(policy.named_weights(), None))
    gen.update_weights(list(scales.named_tensors())[:3])
    with pytest.raises(RuntimeError, match="KV scales for 3 of"):
        gen.finish_weight_update()
    assert gen.weight_version().weights == 4  # still the last complete version
    with pytest.raises(RuntimeError, match="no weight update in progress"):
        gen.finish_weight_update()


def test_calibrate_kv_scales_measures_post_rope_q_and_real_tokens_only(tiny_cfg, tok):
    from nemo_fp8.algorithms.grpo import prompts_batch
    from nemo_fp8.data import PromptSample, MathExample

    cfg = tiny_cfg()
    policy = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))
    texts = ["Q: What is 3 + 4?\n", "Q: What is 12 - 30?\n"]
    samples = [PromptSample(MathExample(t, "0", "test", i), t, tok.encode(t, add_special_tokens=False)) for i, t in enumerate(texts)]
    batch = prompts_batch(samples, tok.pad_token_id)
    scales = policy.calibrate_kv_scales(batch, step=2)
    n = policy.model.config.num_hidden_layers
    assert scales.step == 2 and scales.num_layers == n and (scales.q_amax > 0).all()
    # Reference: hooks on the projections give v exactly; q/k after norm + RoPE need the recorder.
    v_amax = torch.zeros(n)
    hooks = [layer.self_attn.v_proj.register_forward_hook(
        lambda m, i, o, idx=idx: v_amax.__setitem__(idx, max(v_amax[idx], o.detach().abs().max())))
        for idx, layer in enumerate(policy.model.model.layers)]
    with torch.no_grad():
        for s in samples:  # one unpadded sequence at a time: real tokens only
            policy.model(input_ids=torch.tensor([s.prompt_token_ids]))
    for h in hooks:
        h.remove()
    torch.testing.assert_close(scales.v_amax, v_amax)
    # Padding must not count: the padded batch gives the max of the unpadded single sequences.
    single = [policy.calibrate_kv_scales(prompts_batch([s], tok.pad_token_id), step=2) for s in samples]
    for kind in ("q_amax", "k_amax", "v_amax"):
        torch.testing.assert_close(getattr(scales, kind), torch.maximum(*(getattr(x, kind) for x in single)))


def test_fake_quantize_static_is_e4m3_with_saturation():
    scale = torch.tensor(0.5)
    x = torch.tensor([0.0, 0.5 * 1.0625, 0.5 * 1.1, 300.0, -1e6], dtype=torch.bfloat16)
    y = fake_quantize_static(x, scale)
    assert y.dtype == torch.bfloat16
    # e4m3 near 1: 1.0, 1.125 (3 mantissa bits). 1.0625 is the midpoint: to even (1.0); 1.1 -> 1.125.
    assert y[0] == 0 and y[1] == 0.5 and y[2] == 0.5 * 1.125
    assert y[3] == 224.0 and y[4] == -224.0  # saturated at 448 * scale
    assert torch.equal(fake_quantize_static(y, scale), y)  # idempotent: re-quantizing the cache is harmless


def test_torch_engine_fp8_kv_cache_needs_scales_and_uses_them(tiny_cfg, tok):
    cfg = tiny_cfg()
    policy = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))
    plain = _engine(cfg, tok, "fp8")
    vc = cfg.policy.generation.vllm_cfg.model_copy(update={"kv_cache_dtype": "fp8"})
    kv = TorchGenerationBackend(cfg.policy.model_name, vc, CPU, tok.pad_token_id, tok.eos_token_id,
                                cfg.policy.max_total_sequence_length, batch_size=8)
    prompts = [tok.encode(f"Q: What is {i} + 7?\n", add_special_tokens=False) for i in range(8)]
    sampling = SamplingParams(max_new_tokens=8, greedy=True)
    with pytest.raises(RuntimeError, match="no KV scales"):
        kv.generate(prompts, sampling)  # never a silent scale of 1.0
    from nemo_fp8.algorithms.grpo import prompts_batch
    from nemo_fp8.data import MathExample, PromptSample

    samples = [PromptSample(MathExample(str(i), "0", "test", i), str(i), p) for i, p in enumerate(prompts)]
    scales = policy.calibrate_kv_scales(prompts_batch(samples, tok.pad_token_id), step=0)
    for engine in (plain, kv):
        InProcessWeightSync(policy, engine, 2**20).sync(version=0, kv_scales=scales)
    a, b = plain.generate(prompts, sampling), kv.generate(prompts, sampling)
    m = a.token_mask.bool() & b.token_mask.bool()
    diff = (a.generation_logprobs - b.generation_logprobs)[m].abs()
    assert 0 < diff.mean() < 0.1, diff.mean()  # FP8 q/k/v change the numbers, a little
    # A tiny scale saturates everything: the outputs must change a lot, so the scales are really used.
    tiny = KvScales.from_amax(*(torch.full((kv.num_layers,), 1e-3),) * 3, step=1)
    InProcessWeightSync(policy, kv, 2**20).sync(version=1, kv_scales=tiny)
    c = kv.generate(prompts, sampling)
    assert not torch.equal(c.token_ids, b.token_ids)


TINY_MEGATRON = "examples/configs/grpo_math_tiny_megatron_fp8.yaml"


def test_cuda_ipc_refit_is_refused_where_it_cannot_run():
    from nemo_fp8.config import ConfigError, load_config

    ok = load_config(TINY_MEGATRON, ["policy.weight_sync.method=cuda_ipc"])
    assert ok.policy.weight_sync.method == "cuda_ipc"
    with pytest.raises(ConfigError) as e:
        load_config(TINY_MEGATRON, ["policy.weight_sync.method=cuda_ipc", "policy.generation.backend=torch",
                                    "policy.generation.colocated.enabled=false", "policy.data_parallel_size=2",
                                    "policy.train_global_batch_size=16"])
    msg = str(e.value)
    assert "weight_sync.method: 'cuda_ipc'" in msg and "generation.backend: vllm" in msg
    assert "generation.colocated.enabled: true" in msg and "one policy rank (world size 2)" not in msg
    # Megatron tensor parallel 2: each rank exports whole tensors (Megatron-Bridge gathers them onto every rank) and
    # refits the one-GPU engine on its own GPU, so two ranks feed two engines
    tp2 = load_config(TINY_MEGATRON, ["policy.weight_sync.method=cuda_ipc", "policy.data_parallel_size=1",
                                      "policy.megatron_cfg.tensor_model_parallel_size=2"])
    assert tp2.policy.world_size == 2 and tp2.policy.generation.resolve_num_engines(2, True) == 2
    dp2 = load_config(TINY_MEGATRON, ["policy.weight_sync.method=cuda_ipc", "policy.data_parallel_size=2",
                                      "policy.train_global_batch_size=128"])  # two replicas, two one-GPU engines
    assert dp2.policy.weight_sync.method == "cuda_ipc" and dp2.policy.generation.resolve_num_engines(2, True) == 2


def test_cuda_ipc_refit_is_refused_into_a_tensor_parallel_engine():
    """One policy rank's handles cover its own GPU only: an engine of two GPUs would leave its second worker
    without a handle, so ``cuda_ipc`` is refused there, pointing at the transports that work."""
    from nemo_fp8.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(TINY_MEGATRON, ["policy.weight_sync.method=cuda_ipc",
                                    "policy.generation.vllm_cfg.tensor_parallel_size=2"])
    msg = str(e.value)
    assert "weight_sync.method: 'cuda_ipc'" in msg and "a one-GPU engine" in msg and "not 2" in msg
    assert "(valid otherwise: 'auto', 'object_store')" in msg
    cfg = load_config(TINY_MEGATRON, ["policy.generation.vllm_cfg.tensor_parallel_size=2",
                                      "policy.generation.colocated.enabled=false"])  # auto: the object store
    assert cfg.policy.weight_sync.method == "auto" and cfg.policy.generation.engine_gpus == 2


def test_make_weight_sync_picks_the_configured_transport():
    from nemo_fp8.config import load_config
    from nemo_fp8.distributed.weight_sync import CudaIpcWeightSync, ObjectStoreWeightSync
    from nemo_fp8.generation.group import GenerationGroup
    from nemo_fp8.policy.group import PolicyGroup
    from nemo_fp8.trainer import make_weight_sync

    rank0, engine = object(), object()  # actor handles; nothing is called while the transport is chosen
    policy, generation = PolicyGroup([rank0], global_batch_size=8), GenerationGroup([engine])
    cfg = load_config(TINY_MEGATRON, ["policy.weight_sync.method=cuda_ipc", "policy.weight_sync.bucket_size_mb=64"])
    ws = make_weight_sync(cfg, policy, generation)
    assert isinstance(ws, CudaIpcWeightSync)
    assert (ws.policy_workers, ws.generation_workers, ws.bucket_bytes) == ([rank0], [engine], 64 * 2**20)
    assert not ws.packed
    packed = load_config(TINY_MEGATRON, ["policy.weight_sync.method=cuda_ipc", "policy.weight_sync.packed=true"])
    assert make_weight_sync(packed, policy, generation).packed
    assert not make_weight_sync(packed, policy, generation).pack_in_place
    in_place = load_config(TINY_MEGATRON, ["policy.weight_sync.method=cuda_ipc", "policy.weight_sync.packed=true",
                                           "policy.weight_sync.pack_in_place=true"])
    assert make_weight_sync(in_place, policy, generation).pack_in_place
    assert isinstance(make_weight_sync(load_config(TINY_MEGATRON), policy, generation), ObjectStoreWeightSync)
    with pytest.raises(ValueError, match="valid: 'auto', 'in_process'"):
        make_weight_sync(cfg, object(), object())


def test_packed_buckets_belong_to_the_cuda_ipc_refit():
    """``policy.weight_sync.packed`` packs the CUDA IPC refit's buckets; with another transport it is a config error
    naming both keys and what is valid, not a setting that silently does nothing."""
    from nemo_fp8.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(TINY_MEGATRON, ["policy.weight_sync.packed=true"])  # method auto
    msg = str(e.value)
    assert "weight_sync.packed: true" in msg and "weight_sync.method is 'auto'" in msg
    assert "(valid with packed: 'cuda_ipc'; or packed: false)" in msg
    with pytest.raises(ConfigError, match="weight_sync.pack_in_place: true .* needs weight_sync.packed: true"):
        load_config(TINY_MEGATRON, ["policy.weight_sync.method=cuda_ipc", "policy.weight_sync.pack_in_place=true"])


NCCL = ["policy.weight_sync.method=nccl", "policy.generation.colocated.enabled=false"]


def test_nccl_refit_needs_a_vllm_engine_on_gpus_of_its_own():
    """``nccl`` broadcasts from policy rank 0's GPU to the engine's: refused at config time for a colocated engine
    (NCCL cannot hold two ranks of one group on one GPU), the torch engine or a CPU policy; any tensor parallelism
    of the engine, data-parallel or Megatron tensor-parallel policies are fine. ``auto`` never picks it."""
    from nemo_fp8.config import ConfigError, load_config

    assert load_config(TINY_MEGATRON, NCCL).policy.weight_sync.method == "nccl"
    big = load_config(TINY_MEGATRON, [*NCCL, "policy.generation.vllm_cfg.tensor_parallel_size=2",
                                      "policy.megatron_cfg.tensor_model_parallel_size=2",
                                      "policy.data_parallel_size=2"])
    assert big.policy.generation.engine_gpus == 2 and big.policy.world_size == 4
    with pytest.raises(ConfigError) as e:
        load_config(TINY_MEGATRON, ["policy.weight_sync.method=nccl"])  # colocated (the default)
    msg = str(e.value)
    assert "policy.weight_sync.method: 'nccl' broadcasts the weights from the policy's rank 0" in msg
    assert "it needs generation.colocated.enabled: false" in msg and "(valid otherwise: 'auto', 'object_store')" in msg
    assert "generation.backend: vllm" not in msg
    with pytest.raises(ConfigError) as e:
        load_config(TINY_MEGATRON, [*NCCL, "policy.generation.backend=torch", "policy.megatron_cfg.enabled=false",
                                    "policy.device=cpu", "policy.megatron_cfg.fp8_cfg.enabled=false",
                                    "policy.megatron_cfg.logprob_kernel=chunked"])
    msg = str(e.value)
    assert "weight_sync.method: 'nccl'" in msg and "generation.backend: vllm, device: cuda or auto" in msg
    assert "colocated" not in msg.split("weight_sync.method: 'nccl'")[1]
    assert load_config(TINY_MEGATRON, ["policy.generation.colocated.enabled=false"]).policy.weight_sync.method == "auto"


def test_make_weight_sync_builds_the_nccl_transport_without_calling_an_actor():
    """Rank 0 sends, the other Megatron tensor-parallel rank of replica 0 joins the export, and the group is the
    trainer plus the engine's two workers."""
    from nemo_fp8.config import load_config
    from nemo_fp8.distributed.weight_sync import NcclWeightSync
    from nemo_fp8.generation.group import GenerationGroup
    from nemo_fp8.policy.group import PolicyGroup
    from nemo_fp8.trainer import make_weight_sync

    rank0, rank1, engine = object(), object(), object()
    policy, generation = PolicyGroup([rank0, rank1], global_batch_size=8, tp_size=2), GenerationGroup([engine])
    cfg = load_config(TINY_MEGATRON, [*NCCL, "policy.generation.vllm_cfg.tensor_parallel_size=2",
                                      "policy.megatron_cfg.tensor_model_parallel_size=2",
                                      "policy.weight_sync.bucket_size_mb=32"])
    ws = make_weight_sync(cfg, policy, generation)
    assert isinstance(ws, NcclWeightSync)
    assert (ws.policy_worker, ws.generation_workers, ws.bucket_bytes, ws.peers) == (rank0, [engine], 32 * 2**20,
                                                                                     [rank1])
    assert (ws.engine_gpus, ws.world_size) == (2, 3)
    with pytest.raises(ValueError, match="valid: 'auto', 'in_process'"):
        make_weight_sync(cfg, object(), object())


class _Ref:
    """A stand-in for a Ray ``ObjectRef``: the call's result (or error), and whether it has finished."""

    def __init__(self, value=None, error=None, ready=True):
        self.value, self.error, self.ready = value, error, ready


class _Actor:
    """A stand-in for a Ray actor handle: ``handle.method.remote(*args)`` logs ``name.method`` and returns the
    ``_Ref`` that ``methods[method](*args)`` gives (with ``ray.get`` / ``ray.wait`` patched by ``_fake_ray``)."""

    def __init__(self, name, log, **methods):
        self._name, self._log, self._methods = name, log, methods

    def __getattr__(self, method):
        def remote(*args):
            self._log.append((f"{self._name}.{method}", args))
            out = self._methods[method](*args)
            return out if isinstance(out, _Ref) else _Ref(out)
        return types.SimpleNamespace(remote=remote)


def _fake_ray(monkeypatch):
    import ray

    def get(refs):
        if isinstance(refs, list):
            return [get(r) for r in refs]
        if not refs.ready:
            raise AssertionError("ray.get of a call that never finishes: the driver would hang here")
        if refs.error is not None:
            raise refs.error
        return refs.value

    def wait(refs, num_returns=1):
        done = [r for r in refs if r.ready][:num_returns]
        if not done:
            raise AssertionError("ray.wait with nothing finished: the driver would hang here")
        return done, [r for r in refs if r not in done]

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "wait", wait)


def test_nccl_weight_sync_connects_both_sides_and_refits_in_order(monkeypatch):
    """The driver's side of the NCCL refit with stand-in actors (no Ray, no GPU, no NCCL): the group's set-up fires
    the engine's join, then rank 0's (both block until all have joined, so neither is waited on first); a refit is
    start -> peers join the export -> rank 0 broadcasts the buckets -> finish, with the version checked and the
    buckets counted."""
    from nemo_fp8.distributed.weight_sync import NcclWeightSync
    from nemo_fp8.generation.interfaces import WeightVersion

    _fake_ray(monkeypatch)
    log = []
    held = {"version": None}
    engine = _Actor("engine", log, init_weight_transfer=lambda *a: None,
                    start_weight_update=lambda v: held.update(version=v),
                    finish_weight_update=lambda: WeightVersion(weights=held["version"], kv_scales=-1, num_tensors=5))
    rank0 = _Actor("rank0", log, nccl_rendezvous=lambda: ("10.0.0.1", 29511), init_weight_transfer_nccl=lambda *a: None,
                   send_weights_nccl=lambda gen, bucket_bytes, kv: [(3, 300, 0.5), (2, 64, 0.25)])
    peer = _Actor("peer", log, drain_weights=lambda: 0)
    ws = NcclWeightSync(rank0, [engine], bucket_bytes=1024, engine_gpus=2, peers=[peer])
    ws.connect()
    assert log == [("rank0.nccl_rendezvous", ()), ("engine.init_weight_transfer", ("10.0.0.1", 29511, 3, 1)),
                   ("rank0.init_weight_transfer_nccl", ("10.0.0.1", 29511, 3))]
    log.clear()
    stats = ws.sync(version=4)
    assert [name for name, _ in log] == ["engine.start_weight_update", "peer.drain_weights", "rank0.send_weights_nccl",
                                         "engine.finish_weight_update"]
    assert log[2][1] == ([engine], 1024, None)  # rank 0 calls the engine actor itself, bucket by bucket
    assert (stats.version, stats.num_buckets, stats.num_tensors, stats.bytes, stats.max_bucket_bytes) == (4, 2, 5, 364,
                                                                                                         300)
    assert stats.load_seconds == 0.75  # the engine's calls as rank 0 timed them
    engine._methods["finish_weight_update"] = lambda: WeightVersion(weights=3)
    with pytest.raises(RuntimeError, match="engine 0 reports weights of version 3 after an update to 5"):
        ws.sync(version=5)


def test_nccl_group_setup_fails_at_once_when_one_side_fails(monkeypatch):
    """The engine refuses to join (e.g. built without NCCL weight transfer): rank 0 would wait for it forever, so
    the set-up must raise the engine's error without waiting on rank 0's call first."""
    from nemo_fp8.distributed.weight_sync import NcclWeightSync

    _fake_ray(monkeypatch)
    log = []
    engine = _Actor("engine", log, init_weight_transfer=lambda *a: _Ref(error=RuntimeError("built with IPC")))
    rank0 = _Actor("rank0", log, nccl_rendezvous=lambda: ("10.0.0.1", 29511),
                   init_weight_transfer_nccl=lambda *a: _Ref(ready=False))  # blocks: nobody joins
    with pytest.raises(RuntimeError, match="built with IPC"):
        NcclWeightSync(rank0, [engine], bucket_bytes=1024).connect()
    assert [name for name, _ in log] == ["rank0.nccl_rendezvous", "engine.init_weight_transfer",
                                         "rank0.init_weight_transfer_nccl"]


def test_direct_refit_stream_skips_checks_and_records_names_and_update_stats_count_bytes():
    """What rank 0 streams into a vLLM engine (CUDA IPC and NCCL alike): the engine's skipped names dropped, every
    other name checked against its plan before it is yielded (nothing of an unknown weight is sent), the names kept
    for ``note_sent``; and the per-bucket (tensors, bytes) read from vLLM's update info."""
    from nemo_fp8.distributed.weight_sync import direct_refit_stream, update_info_stats
    from nemo_fp8.generation.vllm.refit import RefitPlan

    plan = RefitPlan(set(), expected={"a.weight", "b.weight"})
    names = []
    items = [("a.weight", torch.zeros(2)), ("lm_head.weight", torch.zeros(2)), ("b.weight", torch.zeros(3)),
             ("model.layers.0.self_attn.k_scale", torch.tensor(1.0))]
    out = list(direct_refit_stream(iter(items), plan, {"lm_head.weight"}, names))
    assert [n for n, _ in out] == names == ["a.weight", "b.weight", "model.layers.0.self_attn.k_scale"]
    names.clear()
    stream = direct_refit_stream(iter([("a.weight", torch.zeros(2)), ("c.weight", torch.zeros(2))]), plan, set(), names)
    assert next(stream)[0] == "a.weight"
    with pytest.raises(KeyError, match="no weight 'c.weight'"):
        next(stream)
    assert names == ["a.weight"]
    info = {"names": ["w", "w_scale_inv", "k_scale"], "dtype_names": ["float8_e4m3fn", "float32", "float32"],
            "shapes": [[256, 128], [2, 1], []], "packed": True}
    assert update_info_stats(info) == (3, 256 * 128 + 2 * 4 + 4)
