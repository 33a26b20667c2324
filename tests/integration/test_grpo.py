"""The GRPO loop with local torch backends (no Ray): phases, metrics, IS on/off, dynamic sampling."""

import itertools

import pytest
import torch

from nemo_fp8.algorithms.grpo import RefitController, grpo_step, validate, wake_oom_hint
from nemo_fp8.distributed.weight_sync import InProcessWeightSync
from nemo_fp8.data import PromptDataloader
from nemo_fp8.generation.torch_backend import TorchGenerationBackend
from nemo_fp8.models.hf import load_tokenizer
from nemo_fp8.policy.torch_backend import TorchPolicyBackend
from nemo_fp8.rewards import MathRewardScorer
from nemo_fp8.trainer import prepare_prompts
from nemo_fp8.utils.run_dir import RunFailed
from nemo_fp8.utils.timer import Timer
from nemo_fp8.policy.spec import PolicySpec

CPU = torch.device("cpu")
# temperature 1.0 (the recipe samples at 0.7): the session model's 4 responses to a prompt then differ in length,
# so the even-length reward below gives every step real advantages
SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=16",
         "policy.train_micro_batch_size=8", "policy.generation.max_new_tokens=8", "grpo.max_val_samples=8",
         "policy.generation.temperature=1.0"]


def setup(cfg):
    tok = load_tokenizer(cfg.policy.model_name)
    train, _ = prepare_prompts(cfg, tok)
    policy = TorchPolicyBackend(PolicySpec.from_config(cfg.policy, CPU,
                                                       keep_reference=cfg.loss_fn.reference_policy_kl_penalty > 0))
    gen = TorchGenerationBackend(cfg.policy.model_name, cfg.policy.generation.vllm_cfg, CPU, tok.pad_token_id,
                                 tok.eos_token_id, cfg.policy.max_total_sequence_length, batch_size=16)
    refitter = RefitController(policy, gen, InProcessWeightSync(policy, gen, bucket_bytes=2**20))  # stale: first
    return tok, PromptDataloader(train, cfg.grpo.num_prompts_per_step, seed=0), policy, gen, refitter


@pytest.mark.parametrize("overrides", [
    ["policy.generation.vllm_cfg.precision=fp8", "loss_fn.use_importance_sampling_correction=true"],
    ["policy.generation.vllm_cfg.precision=bfloat16", "loss_fn.use_importance_sampling_correction=false"],
    ["loss_fn.truncated_importance_sampling_type=icepop", "loss_fn.truncated_importance_sampling_ratio_min=0.5",
     "loss_fn.reference_policy_kl_penalty=0.01", "policy.megatron_cfg.fp8_cfg.enabled=true"],
], ids=["fp8_tis", "bf16_no_is", "icepop_kl_fp8train"])
def test_grpo_step_runs_every_phase(tiny_cfg, overrides):
    cfg = tiny_cfg(*SMALL, *overrides)
    tok, loader, policy, gen, refitter = setup(cfg)
    timer = Timer()
    before = next(iter(gen.model.parameters())).clone()
    # Rewards: 1.0 for every even-length response, so each group has signal and the update is real.
    metrics = grpo_step(1, iter(loader), policy, gen, lambda r, a: [float(len(x) % 2 == 0) for x in r], tok, cfg, timer,
                        refitter)
    phases = timer.pop()
    transfer_parts = {f"refit/transfer/{p}" for p in ("start", "export", "load", "finish")}
    assert set(phases) == {"refit", "refit/offload_trainer_state", "refit/transfer", "refit/offload_weights",
                           "engine_wake", "engine_sleep", "generation", "reward", "advantages", "data_processing", "logprobs",
                           "training"} | transfer_parts
    assert sum(v for k, v in phases.items() if k.count("/") == 1 and k.startswith("refit/")) <= phases["refit"]
    assert sum(phases[k] for k in transfer_parts) <= phases["refit/transfer"]  # the transfer's own parts
    assert metrics["refit/num_buckets"] >= 2  # the initial refit, in 1 MiB buckets
    assert refitter.stale and refitter.version == 1  # the engine is refreshed lazily, before the next rollout
    for key in ("train/reward_mean", "mismatch/gen_kl_error", "mismatch/token_mult_prob_error", "loss/is_weight_mean",
                "loss/is_weight_max", "loss/is_frac_tokens_truncated", "loss/grad_norm"):
        assert key in metrics and metrics[key] == metrics[key], key  # present and not NaN
    assert metrics["mismatch/gen_kl_error"] >= 0 and metrics["mismatch/token_mult_prob_error"] >= 1.0
    if not cfg.loss_fn.use_importance_sampling_correction:
        assert metrics["loss/is_weight_min"] == metrics["loss/is_weight_max"] == 1.0
    if cfg.loss_fn.reference_policy_kl_penalty > 0:
        assert "loss/kl_penalty" in metrics
    assert metrics["train/num_sequences_trained"] == 16
    # the next refit reaches the engine: its weights then equal the policy's
    refitter.refit_if_stale(timer)
    assert gen.weight_version().weights == 1
    emb = dict(policy.named_weights())["model.embed_tokens.weight"]
    assert torch.equal(next(iter(gen.model.parameters())), emb.to(torch.bfloat16))
    assert not torch.equal(next(iter(gen.model.parameters())), before)


def test_dynamic_sampling_skips_uninformative_groups(tiny_cfg):
    cfg = tiny_cfg(*SMALL, "grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=2")
    tok, loader, policy, gen, refitter = setup(cfg)
    w0 = {k: v.clone() for k, v in policy.named_weights()}
    batches = iter(loader)
    metrics = grpo_step(1, batches, policy, gen, lambda r, a: [0.0] * len(r), tok, cfg, Timer(), refitter)
    assert metrics["train/num_generation_rounds"] == 2 and metrics["train/num_sequences_trained"] == 0
    assert all(torch.equal(w0[k], v) for k, v in policy.named_weights())  # no update happened
    assert loader.state_dict()["position"] == 2 * cfg.grpo.num_prompts_per_step  # two prompt batches drawn
    assert not refitter.stale and refitter.version == 0  # nothing changed: no refit is due


def test_reward_scorer_on_generated_text(tiny_cfg):
    """The real math reward runs on decoded generations and scores what it extracts."""
    scorer = MathRewardScorer(num_workers=0)
    assert scorer(["Answer: 7", "Answer: 8", "no answer"], ["7", "7", "7"]) == [1.0, 0.0, 0.0]
    cfg = tiny_cfg(*SMALL)
    tok, loader, policy, gen, refitter = setup(cfg)
    metrics = grpo_step(1, iter(loader), policy, gen, scorer, tok, cfg, Timer(), refitter)
    assert 0.0 <= metrics["train/reward_mean"] <= 1.0


def test_the_reward_reads_the_prefilled_response_prefix(tiny_cfg):
    """data.response_prefix is written into the prompts and put back in front of each response for the reward:
    the model generates only the rest of its answer."""
    from nemo_fp8.algorithms.grpo import decode_responses, rollout
    from nemo_fp8.generation.interfaces import SamplingParams

    cfg = tiny_cfg(*SMALL, "data.response_prefix='Answer: '")
    tok, loader, _, gen, _ = setup(cfg)
    prompts = next(iter(loader))
    assert all(p.prompt.endswith("\nAnswer: ") and p.response_prefix == "Answer: " for p in prompts)
    seen = []
    r = rollout(prompts, 2, gen, lambda texts, answers: seen.extend(texts) or [0.0] * len(texts), tok,
                SamplingParams(max_new_tokens=4, temperature=1.0, seed=3), Timer())
    assert r.responses == decode_responses(r.output, tok)  # the generated part only
    assert seen == ["Answer: " + t for t in r.responses]
    scorer = MathRewardScorer(num_workers=0)
    assert scorer(["Answer: 7", "7"], ["7", "7"]) == [1.0, 0.0]  # without the prefix a bare number is no answer


# colocated without the offload: the cache is released before the refit wakes the engine (the last training pass's
# peak would otherwise stay reserved: the engine's wake ran out of memory at the second step on one H200) and after
# it (the export's buckets)
@pytest.mark.parametrize("offload,colocated,expected", [(True, True, ["before", "after"]),
                                                        (False, True, ["release", "release"]), (False, False, [])])
def test_refit_offloads_the_trainer_only_when_asked(tiny_cfg, offload, colocated, expected):
    """policy.generation.colocated.offload_trainer: the refit moves the trainer's state out (NeMo-RL's colocated
    refit) or leaves it (engine on its own GPUs, or both fit; colocated, the allocator's cache still goes back to
    the device for the engine); the engine gets the weights either way."""
    cfg = tiny_cfg(*SMALL)
    tok, loader, policy, gen, _ = setup(cfg)
    calls = []
    policy.offload_before_refit = lambda: calls.append("before")
    policy.offload_after_refit = lambda: calls.append("after")
    generations = []  # gc_generation of each release: the young generations, before the transfer and after it
    policy.release_cached_memory = lambda g: calls.append("release") or generations.append(g) or \
        {"gc": 0.25, "empty_cache": 0.5, "gc_collected": 300.0 * len(calls), "gc_freed_gib": 0.125}
    policy.cuda_memory_gib = lambda: {"allocated_gib": 70.5, "reserved_gib": 80.25}  # as a GPU rank reads them
    refitter = RefitController(policy, gen, InProcessWeightSync(policy, gen, bucket_bytes=2**20),
                               offload_trainer=offload, colocated=colocated)
    timer = Timer()
    metrics = refitter.refit_if_stale(timer)
    assert calls == expected
    assert generations == ([1, 1] if "release" in calls else [])
    # what the trainer keeps on the GPU the engine wakes beside, only where it keeps its state there
    beside = {k: v for k, v in metrics.items() if k.startswith("memory/beside_engine_")}
    assert beside == ({"memory/beside_engine_allocated_gib": 70.5, "memory/beside_engine_reserved_gib": 80.25}
                      if "release" in calls else {})
    phases = timer.pop()  # each release's parts, the one before the transfer and the one after it apart
    for when in ("before", "after"):
        assert (phases.get(f"release_{when}/gc"), phases.get(f"release_{when}/empty_cache")) == \
            ((0.25, 0.5) if "release" in calls else (None, None))
    # what each collection did: the refit's metrics, not timings
    assert not any("gc_collected" in k or "gc_freed" in k for k in phases)
    counts = {k: v for k, v in metrics.items() if k.startswith("release_")}
    assert counts == ({"release_before/gc_collected": 300.0, "release_before/gc_freed_gib": 0.125,
                       "release_after/gc_collected": 600.0, "release_after/gc_freed_gib": 0.125}
                      if "release" in calls else {})
    assert metrics["refit/num_buckets"] >= 1 and gen.weight_version().weights == 0


def test_an_engine_out_of_memory_beside_the_trainer_names_its_gib_and_the_keys(tiny_cfg):
    """Colocated with the trainer's state kept (offload_trainer=false), an engine that cannot wake for lack of memory
    stops the run with the trainer's GiB on the GPU and the keys that make room; other failures pass unchanged."""
    cfg = tiny_cfg(*SMALL)
    tok, loader, policy, gen, _ = setup(cfg)
    policy.cuda_memory_gib = lambda: {"allocated_gib": 79.4, "reserved_gib": 91.6}
    refitter = RefitController(policy, gen, InProcessWeightSync(policy, gen, bucket_bytes=2**20),
                               offload_trainer=False, colocated=True)
    failures = iter(["engine 0 failed: wake_up: CUDA Error: out of memory at cumem_allocator.cpp:139",
                     "engine 0 failed: the actor died"])

    def wake():
        raise RunFailed(next(failures))

    gen.prepare_for_generation = wake
    with pytest.raises(RunFailed) as e:
        with refitter.generating(Timer()):
            pass
    text = str(e.value)
    assert text.startswith("engine 0 failed: wake_up: CUDA Error: out of memory")
    assert "held 91.6 GiB of this GPU beside the engine (79.4 GiB of live tensors" in text
    for key in ("gpu_memory_utilization", "train_mb_tokens", "offload_trainer=true"):
        assert key in text
    with pytest.raises(RunFailed, match=r"^engine 0 failed: the actor died$"):
        with refitter.generating(Timer()):
            pass


def test_wake_oom_hint_only_for_memory_and_a_trainer_on_the_gpu():
    assert wake_oom_hint("CUDA out of memory", {}) == ""  # the trainer's state left the GPU (or a CPU run)
    assert wake_oom_hint("actor died", {"reserved_gib": 1.0}) == ""
    assert "1.0 GiB" in wake_oom_hint("RuntimeError: CUDA Error: Out Of Memory", {"reserved_gib": 1.0})


def test_validation_accuracy_per_data_source(tiny_cfg):
    """Validation over two sources reports each one's accuracy beside the overall mean."""
    import dataclasses

    cfg = tiny_cfg(*SMALL, "grpo.val_batch_size=3")
    tok, _, _, gen, refitter = setup(cfg)
    _, val = prepare_prompts(cfg, tok)
    val = val[:6]
    # relabel the last two as another source; the reward marks the first three responses right (whatever they say)
    val = val[:4] + [dataclasses.replace(s, example=dataclasses.replace(s.example, data_source="other"))
                     for s in val[4:]]
    calls = iter(range(100))
    m = validate(gen, lambda r, a: [float(next(calls) < 3) for _ in r], tok, val, cfg, 0, refitter, Timer())
    assert m["val/accuracy"] == pytest.approx(3 / 6) and m["val/num_samples"] == 6
    src = val[0].example.data_source
    assert m[f"val/accuracy/{src}"] == pytest.approx(3 / 4) and m["val/accuracy/other"] == 0.0
    one = validate(gen, lambda r, a: [1.0] * len(r), tok, val[:4], cfg, 0, refitter, Timer())
    assert set(one) == {"val/accuracy", "val/num_samples"}  # one source: no per-source keys


def test_prompt_batches_follow_the_dataloader_order(tiny_cfg):
    cfg = tiny_cfg(*SMALL)
    tok = load_tokenizer(cfg.policy.model_name)
    train, val = prepare_prompts(cfg, tok)
    assert not {s.prompt for s in train} & {s.prompt for s in val}  # validation is held out
    a = [[s.prompt for s in b] for b in itertools.islice(PromptDataloader(train, 4, seed=0), 3)]
    b = [[s.prompt for s in b] for b in itertools.islice(PromptDataloader(train, 4, seed=0), 3)]
    assert a == b


def test_fp8_kv_cache_scales_follow_every_step(tiny_cfg):
    """FP8 KV cache: scales measured after each training step ride the refit; stale ones stop the rollout."""
    from nemo_fp8.algorithms.grpo import prompts_batch

    cfg = tiny_cfg(*SMALL, "policy.generation.vllm_cfg.kv_cache_dtype=fp8")
    tok, loader, policy, gen, _ = setup(cfg)
    refitter = RefitController(policy, gen, InProcessWeightSync(policy, gen, 2**20), requires_kv_scales=True)
    batches = iter(loader)
    first = next(iter(PromptDataloader(prepare_prompts(cfg, tok)[0], 4, seed=0)))
    refitter.mark_stale(0, policy.calibrate_kv_scales(prompts_batch(first, tok.pad_token_id), step=0))
    reward = lambda r, a: [float(len(x) % 2 == 0) for x in r]  # noqa: E731
    m1 = grpo_step(1, batches, policy, gen, reward, tok, cfg, Timer(), refitter)
    assert {"kv_scales/q_scale_max", "kv_scales/k_scale_min", "kv_scales/v_scale_max"} <= m1.keys()
    assert m1["kv_scales/calibration_samples"] == 16  # 4 x 4 rows, under the default cap of 256
    assert gen.weight_version().kv_scales == 0 and refitter.kv_scales.step == 1
    step1_scales = refitter.kv_scales
    for i in range(step1_scales.num_layers):  # the step logs every layer's scales, exactly those the refit sends
        for kind in "qkv":
            assert m1[f"kv_scales/layer_{i}/{kind}_scale"] == float(getattr(step1_scales, f"{kind}_scale")[i])
    grpo_step(2, batches, policy, gen, reward, tok, cfg, Timer(), refitter)  # refits weights + step-1 scales first
    assert gen.weight_version().kv_scales == 1
    torch.testing.assert_close(gen.kv_scales["k"], step1_scales.k_scale)
    assert not torch.equal(step1_scales.k_scale, refitter.kv_scales.k_scale)  # the scales follow the weights
    refitter.mark_stale(3)  # weights changed, no scales measured on them: refused, never stale scales
    with pytest.raises(RuntimeError, match="needs scales measured on these weights"):
        refitter.refit_if_stale(Timer())


def test_fp8_kv_calibration_reads_at_most_its_cap(tiny_cfg):
    """kv_calibration_max_samples: the calibration forward reads that many rows, spread over the prompt groups,
    and its scales are those of exactly these rows."""
    from nemo_fp8.algorithms.grpo import prompts_batch
    from nemo_fp8.fp8.kv_scales import calibration_rows

    cfg = tiny_cfg(*SMALL, "policy.generation.vllm_cfg.kv_cache_dtype=fp8",
                   "policy.generation.vllm_cfg.kv_calibration_max_samples=4")
    tok, loader, policy, gen, _ = setup(cfg)
    refitter = RefitController(policy, gen, InProcessWeightSync(policy, gen, 2**20), requires_kv_scales=True)
    first = next(iter(PromptDataloader(prepare_prompts(cfg, tok)[0], 4, seed=0)))
    refitter.mark_stale(0, policy.calibrate_kv_scales(prompts_batch(first, tok.pad_token_id), step=0))
    seen = []
    calibrate = policy.calibrate_kv_scales

    def recording(batch, step, margin=1.0):  # the real calibration; the rows it got are kept to check below
        seen.append(batch)
        return calibrate(batch, step, margin)

    policy.calibrate_kv_scales = recording
    m = grpo_step(1, iter(loader), policy, gen, lambda r, a: [float(len(x) % 2 == 0) for x in r], tok, cfg, Timer(),
                  refitter)
    assert m["kv_scales/calibration_samples"] == 4 and len(seen) == 1 and seen[0].size == 4
    assert calibration_rows(16, 4).tolist() == [0, 4, 8, 12]  # one response of each of the 4 prompts
    again = calibrate(seen[0], 1)
    torch.testing.assert_close(refitter.kv_scales.k_scale, again.k_scale)
    torch.testing.assert_close(refitter.kv_scales.v_scale, again.v_scale)


def test_an_engine_whose_sleep_drops_its_weights_is_refit_before_every_wake(tiny_cfg):
    """vLLM's sleep level 2 discards the weights: the controller refits before each wake, also when no training
    step came between two rollouts (a validation right after a step's rollout); without it the second rollout
    would run on the discarded weights."""
    cfg = tiny_cfg(*SMALL)
    tok, loader, policy, gen, _ = setup(cfg)
    asleep = gen.finish_generation

    def sleep_dropping_weights():  # what level 2 leaves: memory whose contents are gone
        asleep()
        with torch.no_grad():
            for p in gen.model.parameters():
                p.fill_(float("nan"))

    gen.finish_generation = sleep_dropping_weights
    sync = InProcessWeightSync(policy, gen, bucket_bytes=2**20)
    for discards, finite_after in ((True, True), (False, False)):
        refitter = RefitController(policy, gen, sync, sleep_discards_weights=discards)
        for round_idx in range(2):
            with refitter.generating(Timer()):
                finite = all(bool(torch.isfinite(p).all()) for p in gen.model.parameters())
                assert finite == (round_idx == 0 or finite_after), (discards, round_idx)
        assert refitter.stale == discards
