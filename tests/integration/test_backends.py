"""The torch reference backends on the project's tiny model: contracts, refit, FP8 paths."""

import warnings

import pytest
import torch

from nemo_fp8.batch import TrainBatch
from nemo_fp8.fp8 import Fp8BlockLinear, Fp8TrainingLinear
from nemo_fp8.generation import SamplingParams
from nemo_fp8.generation.torch_backend import TorchGenerationBackend
from nemo_fp8.models.hf import load_tokenizer
from nemo_fp8.policy.torch_backend import TorchPolicyBackend
from nemo_fp8.policy.spec import PolicySpec

CPU = torch.device("cpu")


def make_generation(cfg, tok, **vllm_updates):
    vc = cfg.policy.generation.vllm_cfg.model_copy(update=vllm_updates)
    return TorchGenerationBackend(cfg.policy.model_name, vc, CPU, tok.pad_token_id, tok.eos_token_id,
                                  cfg.policy.max_total_sequence_length, batch_size=8)


def prompts(tok, n=6):
    texts = ["Q: What is 3 + 4?\n", "Q: What is 12 - 30?\n", "Q: What is 1 + 1?\n"]
    return [tok.encode(texts[i % 3], add_special_tokens=False) for i in range(n)]


def to_batch(out, adv=None):
    adv = torch.zeros(out.token_ids.shape[0]) if adv is None else adv
    return TrainBatch(out.token_ids, out.prompt_lengths, out.response_lengths, adv, out.generation_logprobs)


def test_generation_contract_and_reproducibility(tiny_cfg, tok):
    gen = make_generation(tiny_cfg(), tok, precision="bfloat16")
    p = prompts(tok, 10)  # 10 prompts, batch_size 8: two chunks of different widths
    out = gen.generate(p, SamplingParams(max_new_tokens=7, seed=3)).validate()
    assert out.token_ids.shape[0] == 10 and (out.response_lengths <= 7).all()
    for i, ids in enumerate(p):  # prompts are kept verbatim at the start (right padding)
        assert out.token_ids[i, : len(ids)].tolist() == ids
    mask = out.token_mask.bool()
    assert (out.generation_logprobs[~mask] == 0).all() and (out.generation_logprobs[mask] < 0).all()
    again = gen.generate(p, SamplingParams(max_new_tokens=7, seed=3))
    assert torch.equal(out.token_ids, again.token_ids)
    # rows that ended early end with EOS; the others are marked truncated
    for i in range(10):
        last = out.token_ids[i, out.prompt_lengths[i] + out.response_lengths[i] - 1]
        assert bool(out.truncated[i]) == (last.item() != tok.eos_token_id)


def test_generation_warns_nothing(tiny_cfg, tok):
    """The decode loop passes the KV cache under the name this transformers takes: given the former
    ``past_key_values``, transformers 5.2x warns (FutureWarning) on every forward, in every worker's log."""
    gen = make_generation(tiny_cfg(), tok, precision="bfloat16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gen.generate(prompts(tok, 2), SamplingParams(max_new_tokens=3, seed=0))
    assert not [w for w in caught if "past_key_values" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.parametrize("precision", ["bfloat16", "fp8"])
def test_repeated_prompts_share_one_prompt_pass(tiny_cfg, tok, precision, monkeypatch):
    """GRPO's n responses per prompt: the prompt pass runs once per distinct prompt and its KV cache and logits are
    copied to the repeats; every row then decodes as if its prompt had had a pass of its own."""
    import nemo_fp8.generation.torch_backend as tb

    gen = make_generation(tiny_cfg(), tok, precision=precision)
    p = [q for q in prompts(tok, 3) for _ in range(3)]  # 3 distinct prompts x 3 rows, batch_size 8: two chunks
    widths = []
    hook = gen.model.register_forward_pre_hook(lambda m, a, kw: widths.append(kw["input_ids"].shape), with_kwargs=True)
    seeds = list(range(100, 109))
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=1)
    shared = gen.generate(p, sampling, request_seeds=seeds)
    hook.remove()
    assert [w[0] for w in widths if w[1] > 1] == [3, 1]  # prompt passes: rows 0-7 hold 3 prompts, row 8 one
    assert tb._distinct_rows([[1, 2], [3], [1, 2], [3], [4]]) == ([0, 1, 4], [0, 1, 0, 1, 2])
    monkeypatch.setattr(tb, "_distinct_rows", lambda rows: (list(range(len(rows))), list(range(len(rows)))))
    each = gen.generate(p, sampling, request_seeds=seeds)  # a prompt pass for every row
    assert torch.equal(shared.token_ids, each.token_ids)
    torch.testing.assert_close(shared.generation_logprobs, each.generation_logprobs, atol=2e-2, rtol=0)


def test_response_limits_cap_each_request_at_its_own_limit(tiny_cfg, tok):
    """``SamplingParams.response_limits``: every row stops at its own drawn limit, or earlier at EOS."""
    from nemo_fp8.generation.interfaces import ResponseLimits, request_max_new_tokens, request_seed

    gen = make_generation(tiny_cfg(), tok, precision="bfloat16")
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5,
                              response_limits=ResponseLimits(median_tokens=2, sigma=1.0, min_tokens=1))
    seeds = [request_seed(5, i) for i in range(12)]
    limits = request_max_new_tokens(sampling, 12, seeds)
    assert len(set(limits)) > 2
    out = gen.generate(prompts(tok, 12), sampling, request_seeds=seeds).validate()
    for i, n in enumerate(out.response_lengths.tolist()):
        assert 1 <= n <= limits[i]
        assert bool(out.truncated[i]) == (out.token_ids[i, out.prompt_lengths[i] + n - 1].item() != tok.eos_token_id)
        if out.truncated[i]:
            assert n == limits[i]
    assert out.truncated.any()


def test_max_total_sequence_length_caps_responses(tiny_cfg, tok):
    cfg = tiny_cfg("policy.max_total_sequence_length=22", "data.max_input_seq_length=20")
    gen = make_generation(cfg, tok, precision="bfloat16")
    p = prompts(tok, 3)
    out = gen.generate(p, SamplingParams(max_new_tokens=12, seed=0))
    assert ((out.prompt_lengths + out.response_lengths) <= 22).all()
    with pytest.raises(ValueError, match="max_total_sequence_length"):
        gen.generate([list(range(5, 27))], SamplingParams(max_new_tokens=2))


def test_trainer_scores_the_same_distribution_as_the_sampler(tiny_cfg, shipped_tiny_model):
    """bf16 engine vs fp32 trainer: tiny differences; an FP8 engine differs more but stays close.

    The shipped model (the same weights on every machine) with seeded noise: a warm start built on this CPU
    answers these prompts with probability ~1 on some machines, where every log-prob is ~0 and both engines agree
    with the trainer to 1e-5."""
    cfg = tiny_cfg("policy.generation.temperature=0.7", f"policy.model_name={shipped_tiny_model}")
    tok = load_tokenizer(str(shipped_tiny_model))
    pol = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU, temperature=0.7))
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in pol.model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=noise))
    errors = {}
    for precision in ("bfloat16", "fp8"):
        gen = make_generation(cfg, tok, precision=precision)
        gen.update_weights(pol.named_weights())
        out = gen.generate(prompts(tok, 8), SamplingParams(max_new_tokens=8, temperature=0.7, seed=1))
        batch = to_batch(out)
        prev = pol.get_logprobs(batch)
        m = batch.token_mask.bool()
        errors[precision] = (prev - out.generation_logprobs)[m].abs().mean().item()
        assert (prev[~m] == 0).all()
    # Measured with the native kernels and ATEN_CPU_CAPABILITY=default alike: bf16 0.0068, fp8 0.025 (nats per token).
    assert errors["bfloat16"] < 0.02 and errors["fp8"] < 0.05, errors
    assert errors["fp8"] > errors["bfloat16"], errors


def test_fp8_layer_policy_and_refit_in_place(tiny_cfg, tok):
    cfg = tiny_cfg()
    gen = make_generation(cfg, tok, precision="fp8", num_first_layers_in_bf16=1, num_last_layers_in_bf16=1)
    layers = gen.model.model.layers
    assert not any(isinstance(m, Fp8BlockLinear) for m in layers[0].modules())
    assert not any(isinstance(m, Fp8BlockLinear) for m in layers[-1].modules())
    assert sum(isinstance(m, Fp8BlockLinear) for m in layers[1].modules()) == 7
    assert not isinstance(gen.model.lm_head, Fp8BlockLinear)
    assert "model.layers.0.self_attn.qkv_proj" in gen.plan.vllm_ignored_layers
    q = layers[1].self_attn.q_proj
    ptrs = (q.weight.data_ptr(), q.weight_scale_inv.data_ptr())
    pol = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))
    with torch.no_grad():
        pol.model.model.layers[1].self_attn.q_proj.weight.mul_(3.0)
    gen.update_weights(pol.named_weights())
    assert (q.weight.data_ptr(), q.weight_scale_inv.data_ptr()) == ptrs  # refit writes in place
    w = pol.model.model.layers[1].self_attn.q_proj.weight.detach()
    expect = w.reshape(2, 128, 2, 128).abs().amax(dim=(1, 3)) / 448.0
    torch.testing.assert_close(q.weight_scale_inv, expect)
    with pytest.raises(KeyError, match="no weight"):
        gen.update_weights({"model.layers.9.mlp.up_proj.weight": w})


def test_layer_counts_out_of_range_name_the_key(tiny_cfg, tok):
    with pytest.raises(ValueError, match="num_first_layers_in_bf16"):
        make_generation(tiny_cfg(), tok, precision="fp8", num_first_layers_in_bf16=9)


def _advantage_batch(pol, gen, tok):
    out = gen.generate(prompts(tok, 8), SamplingParams(max_new_tokens=6, seed=5))
    adv = torch.tensor([1.0, -1.0] * 4)
    batch = to_batch(out, adv)
    batch.prev_logprobs = pol.get_logprobs(batch)
    return batch


@pytest.mark.parametrize("fp8", [None, ("e4m3", "tensorwise"), ("hybrid", "blockwise")])
def test_train_step_moves_logprobs_with_the_advantage(tiny_cfg, tok, fp8):
    from nemo_fp8.algorithms.loss import ClippedPGLossFn

    overrides = ["policy.train_global_batch_size=8", "policy.train_micro_batch_size=4", "grpo.num_prompts_per_step=8",
                 "grpo.num_generations_per_prompt=1", "policy.optimizer.lr=1e-3"]
    if fp8:
        overrides += ["policy.megatron_cfg.fp8_cfg.enabled=true", f"policy.megatron_cfg.fp8_cfg.fp8={fp8[0]}",
                      f"policy.megatron_cfg.fp8_cfg.fp8_recipe={fp8[1]}"]
    cfg = tiny_cfg(*overrides)
    pol = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))
    if fp8:
        assert len(pol.fp8_modules) == 7 * pol.model.config.num_hidden_layers and isinstance(pol.model.model.layers[0].mlp.up_proj, Fp8TrainingLinear)
    gen = make_generation(cfg, tok, precision="bfloat16")
    gen.update_weights(pol.named_weights())
    batch = _advantage_batch(pol, gen, tok)
    metrics = pol.train(batch, ClippedPGLossFn(cfg.loss_fn))
    assert {"loss", "grad_norm", "is_weight_mean", "clip_fraction"} <= metrics.keys()
    after = pol.get_logprobs(batch)
    m = batch.token_mask
    delta = ((after - batch.prev_logprobs) * m).sum(1) / m.sum(1).clamp(min=1)  # [B] mean change per sequence
    rows = m.sum(1) > 0
    assert (delta[rows & (batch.advantages > 0)].mean() > 0) and (delta[rows & (batch.advantages < 0)].mean() < 0)


def test_micro_batching_matches_one_big_batch(tiny_cfg, tok):
    """Summed micro-batch gradients (global normalisation) equal the full-batch gradient."""
    from nemo_fp8.algorithms.loss import ClippedPGLossFn

    grads = []
    for mbs in (8, 2):
        cfg = tiny_cfg("policy.train_global_batch_size=8", f"policy.train_micro_batch_size={mbs}",
                       "grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=1")
        torch.manual_seed(0)
        pol = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))
        gen = make_generation(cfg, tok, precision="bfloat16")
        batch = _advantage_batch(pol, gen, tok)
        pol.optimizer.step = lambda: None  # keep weights: compare the accumulated gradients only
        pol.train(batch, ClippedPGLossFn(cfg.loss_fn))
        grads.append(torch.cat([p.grad.flatten() for p in pol.model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_policy_save_load_round_trip(tiny_cfg, tok, tmp_path):
    from nemo_fp8.algorithms.loss import ClippedPGLossFn

    cfg = tiny_cfg("policy.train_global_batch_size=8", "policy.train_micro_batch_size=8",
                   "grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=1")
    pol = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))
    gen = make_generation(cfg, tok, precision="bfloat16")
    batch = _advantage_batch(pol, gen, tok)
    pol.train(batch, ClippedPGLossFn(cfg.loss_fn))
    pol.save(tmp_path / "p")
    other = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))
    other.load(tmp_path / "p")
    torch.testing.assert_close(other.get_logprobs(batch), pol.get_logprobs(batch))
    assert other.num_updates == 1
    assert other.optimizer.state_dict()["state"].keys() == pol.optimizer.state_dict()["state"].keys()


def test_train_reads_nothing_per_micro_batch(tiny_cfg, tok):
    """Host reads (a GPU sync each, on CUDA) in ``train`` barely grow with the number of micro-batches:
    metrics stay tensors until one reduction per global batch. The one read left per micro-batch is
    inside the HF model's forward (``transformers.masking_utils._ignore_causal_mask_sdpa`` checks
    the padding mask); before the change each micro-batch made 34 (measured with the same counter:
    loss ``.item()``s, mask indexing, metric ``float``s, the width). The padded path: the shared-prefix forward
    (``policy.shared_prefix_forward``, on in the tiny recipe) groups each micro-batch's rows by their prompt tokens
    on the host, 4 more reads per micro-batch (measured), which cost nothing on the CPU it is meant for."""
    from nemo_fp8.algorithms.loss import ClippedPGLossFn
    from nemo_fp8.utils.host_sync import count_host_syncs

    counts = {}
    for mbs in (4, 1):
        cfg = tiny_cfg("policy.train_global_batch_size=8", f"policy.train_micro_batch_size={mbs}",
                       "grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=1",
                       "loss_fn.use_importance_sampling_correction=true", "policy.shared_prefix_forward=false")
        pol = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))
        gen = make_generation(cfg, tok, precision="bfloat16")
        batch = _advantage_batch(pol, gen, tok)
        with count_host_syncs() as c:
            pol.train(batch, ClippedPGLossFn(cfg.loss_fn))
        counts[mbs] = c.count
    per_micro_batch = (counts[1] - counts[4]) / (8 - 2)
    assert per_micro_batch <= 1, counts  # the HF forward's own padding-mask check


def _record_lrs(pol):
    """A list that receives the learning rate of each of ``pol``'s real optimizer updates."""
    seen, step = [], pol.optimizer.step

    def recording_step(*a, **k):
        seen.append(pol.optimizer.param_groups[0]["lr"])
        return step(*a, **k)

    pol.optimizer.step = recording_step
    return seen


def test_the_lr_warm_up_runs_update_by_update_and_continues_after_a_resume(tiny_cfg, tok, tmp_path):
    from nemo_fp8.algorithms.loss import ClippedPGLossFn
    from nemo_fp8.config import ConfigError

    cfg = tiny_cfg("policy.train_global_batch_size=4", "policy.train_micro_batch_size=4", "grpo.num_prompts_per_step=8",
                   "grpo.num_generations_per_prompt=1", "policy.optimizer.lr=1e-3", "policy.optimizer.lr_warmup_steps=4",
                   "policy.optimizer.lr_warmup_init=1e-4")
    pol = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))
    batch = _advantage_batch(pol, make_generation(cfg, tok, precision="bfloat16"), tok)
    seen = _record_lrs(pol)
    metrics = pol.train(batch, ClippedPGLossFn(cfg.loss_fn))  # 8 rows, global batch 4: two updates
    assert seen == pytest.approx([1e-4, 3.25e-4])  # 1e-4 + 9e-4 * n / 4 after n updates (megatron-core's warm-up)
    assert metrics["lr"] == pytest.approx(2.125e-4)  # logged as loss/lr: the mean over the step's updates
    pol.save(tmp_path / "p")
    resumed = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))
    resumed.load(tmp_path / "p")
    seen = _record_lrs(resumed)
    resumed.train(batch, ClippedPGLossFn(cfg.loss_fn))
    assert resumed.num_updates == 4 and seen == pytest.approx([5.5e-4, 7.75e-4])  # the warm-up goes on, not over
    with pytest.raises(ConfigError, match="lr_warmup_init"):
        tiny_cfg("policy.optimizer.lr=1e-4", "policy.optimizer.lr_warmup_init=1e-3")


def test_the_lr_decay_runs_update_by_update_and_continues_after_a_resume(tiny_cfg, tok, tmp_path):
    from nemo_fp8.algorithms.loss import ClippedPGLossFn
    from nemo_fp8.config import ConfigError

    cfg = tiny_cfg("policy.train_global_batch_size=4", "policy.train_micro_batch_size=4", "grpo.num_prompts_per_step=8",
                   "grpo.num_generations_per_prompt=1", "policy.optimizer.lr=1e-3", "policy.optimizer.min_lr=1e-4",
                   "policy.optimizer.lr_decay_style=WSD", "policy.optimizer.lr_decay_steps=4",
                   "policy.optimizer.wsd_decay_steps=2")
    pol = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))
    batch = _advantage_batch(pol, make_generation(cfg, tok, precision="bfloat16"), tok)
    seen = _record_lrs(pol)
    pol.train(batch, ClippedPGLossFn(cfg.loss_fn))  # two updates at lr: WSD holds it until update 2
    assert seen == pytest.approx([1e-3, 1e-3])
    pol.save(tmp_path / "p")
    resumed = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU))
    resumed.load(tmp_path / "p")
    seen = _record_lrs(resumed)
    resumed.train(batch, ClippedPGLossFn(cfg.loss_fn))
    assert seen == pytest.approx([1e-3, 5.5e-4])  # n=2: still lr; n=3: half-way from lr to min_lr
    resumed.train(batch, ClippedPGLossFn(cfg.loss_fn))
    assert seen[2:] == pytest.approx([1e-4, 1e-4])  # from lr_decay_steps on: min_lr
    with pytest.raises(ConfigError, match="lr_decay_steps"):
        tiny_cfg("policy.optimizer.lr_decay_style=cosine", "policy.optimizer.lr_decay_steps=null")
