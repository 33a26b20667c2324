"""Weight sync in one process: buckets, packing, versions, FP8 KV scales, completeness."""

import pytest
import torch

from nemo_fp8.distributed.weight_sync import (InProcessWeightSync, iter_buckets, pack_bucket, unpack_bucket,
                                              weight_stream)
from nemo_fp8.fp8 import Fp8BlockLinear
from nemo_fp8.fp8.kv_scales import KvScales, fake_quantize_static, is_kv_scale_name, parse_kv_scale_name
from nemo_fp8.fp8.quantize import quantize_weight_blockwise
from nemo_fp8.generation import SamplingParams
from nemo_fp8.generation.torch_backend import TorchGenerationBackend
from nemo_fp8.models.hf import load_tokenizer
from nemo_fp8.policy.torch_backend import TorchPolicyBackend

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


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def _engine(cfg, tok, precision):
    vc = cfg.policy.generation.vllm_cfg.model_copy(update={"precision": precision})
    return TorchGenerationBackend(cfg.policy.model_name, vc, CPU, tok.pad_token_id, tok.eos_token_id,
                                  cfg.policy.max_total_sequence_length, batch_size=8)


@pytest.mark.parametrize("precision", ["bfloat16", "fp8"])
def test_in_process_sync_loads_every_weight_with_its_version(tiny_cfg, tok, precision):
    cfg = tiny_cfg()
    policy = TorchPolicyBackend(cfg.policy, CPU)
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


def test_kv_scales_travel_with_the_weights_and_incomplete_updates_fail(tiny_cfg, tok):
    cfg = tiny_cfg()
    policy = TorchPolicyBackend(cfg.policy, CPU)
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
    policy = TorchPolicyBackend(cfg.policy, CPU)
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
    policy = TorchPolicyBackend(cfg.policy, CPU)
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
    assert "generation.colocated.enabled: true" in msg and "one policy rank (world size 2)" in msg


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
    from nemo_fp8.distributed.worker_groups import GenerationGroup, PolicyGroup
    from nemo_fp8.trainer import make_weight_sync

    rank0, engine = object(), object()  # actor handles; nothing is called while the transport is chosen
    policy, generation = PolicyGroup([rank0], global_batch_size=8), GenerationGroup(engine)
    cfg = load_config(TINY_MEGATRON, ["policy.weight_sync.method=cuda_ipc", "policy.weight_sync.bucket_size_mb=64"])
    ws = make_weight_sync(cfg, policy, generation)
    assert isinstance(ws, CudaIpcWeightSync)
    assert (ws.policy_worker, ws.generation_worker, ws.bucket_bytes) == (rank0, engine, 64 * 2**20)
    assert isinstance(make_weight_sync(load_config(TINY_MEGATRON), policy, generation), ObjectStoreWeightSync)
    with pytest.raises(ValueError, match="valid: 'auto', 'in_process'"):
        make_weight_sync(cfg, object(), object())
