"""Training benchmark: BF16 vs TransformerEngine FP8 recipes through the megatron policy backend.

One run prints one table. Each (shape, recipe) runs in its own subprocess (clean GPU memory, and
TE reads its block-scaling convention at import) on a random-weight model built by
Megatron-Bridge from a Qwen3-8B- or Qwen3-30B-A3B-shaped config cut to a few layers:

    python tools/bench_train.py --shapes dense,moe --recipes bf16,e4m3-tensorwise,hybrid-tensorwise,e4m3-blockwise \
        --batch 2 --seq-len 4096 --micro-batches 16 --steps 7 --warmup 2

Columns, per micro-batch of ``batch x seq_len`` tokens. The four forward + backward columns are
timed in interleaved rounds (``timed_interleaved``), so that the GPU's drift during a run falls on
each alike; each is the median over ``--steps`` rounds.

* ``raw f+b``: megatron-core alone: ``GPTModel(input_ids, position_ids, labels=...)`` with its own
  vocab-parallel cross entropy, ``.mean().backward()`` (what ``../shared/gpu-host/README.md``
  measured: BF16 218.2 ms, e4m3 tensorwise 173.3 ms, blockwise 185.2 ms on the dense slice);
* ``ours f+b``: our backend's forward + backward: chunked vocab-parallel log-probs and the GRPO
  loss (``ClippedPGLossFn``), no optimizer; ``ours/raw`` is its ratio to ``raw f+b``;
* ``fused f+b``: the same with ``megatron_cfg.logprob_kernel: fused`` (the chunked math in one
  Triton pass each way);
* ``te f+b``: the same with ``megatron_cfg.logprob_kernel: te`` (TransformerEngine's fused
  ``parallel_cross_entropy``, the kernel behind ``raw f+b``'s loss with ``cross_entropy_fusion_impl='te'``);
* ``step``: a full training step of the backend (``train``: forward, backward, gradient sync,
  distributed-optimizer step) over a global batch of ``--micro-batches`` micro-batches (a GRPO step
  has many: the 8B configs' 2,048 samples of up to 4,096 tokens make 4 optimizer steps of 512
  micro-batches each, so the optimizer's cost is shared by all of them), per micro-batch, with the
  ``--logprob-kernel`` log-probs (default ``fused``, the megatron example configs' kernel);
  ``tok/s`` = tokens / that; ``vs bf16`` = tok/s ratio to BF16 of the same shape; ``fused vs
  bf16`` and ``raw vs bf16`` the same ratio for ``fused f+b`` and ``raw f+b``;
* ``peak GiB``: ``torch.cuda.max_memory_allocated`` over the whole child;
* ``--profile N``: a second table, N profiled ``fused`` forward + backward passes: ms by kernel
  category (``tools/profile_rollout.py``'s), GPU kernel time, host time (wall - GPU) and kernels
  launched per pass;
* ``--host-profile N``: where the host's time goes in N ``fused`` passes under cProfile: own ms by library
  part (TE modules, quantizers, recipe state, C++ extension calls, megatron-core, autograd) and the top
  functions (``tools/lab/host_profile.py``).

``--workload rl``: a GRPO step's shapes instead of fixed micro-batches. ``--rl-responses`` sequences of a
``--rl-prompt``-token prompt plus a response uniform in ``--rl-response-min..--rl-response-max`` tokens (seeded,
the same batch for every child), one full step each round: ``get_logprobs`` then ``train`` (one optimizer
step), each recipe unpacked (the 8B configs' ``train_micro_batch_size: 1``, ``logprob_batch_size: 2``: rows
padded to the longest of their micro-batch) and packed (``policy.sequence_packing`` with the 8B configs' values:
``train_mb_tokens`` 4096, ``logprob_mb_tokens`` 16384, ``sequence_length_round`` 64). Columns: log-probs and
train seconds, micro-batches and packing efficiency (real / computed tokens) of the train step, tokens/s, the
step-time ratios to unpacked BF16 and to packed BF16, and (packed rows) the engine's own ceiling measured in the
same child: ``raw f+b`` of one micro-batch of ``train_mb_tokens`` tokens and its ratio to BF16's, what an FP8
recipe gains before our step adds log-probs, the loss, gradient sync and the optimizer:

    python tools/bench_train.py --workload rl --shapes dense --recipes bf16,e4m3-tensorwise,e4m3-blockwise

``--tp N`` runs each ``--workload rl`` child as N ranks (``torch.distributed.run``; one GPU each, the first N visible)
in megatron-core tensor parallel N with sequence parallelism, the layout of the 8B configs (add
``@activation_checkpointing=true`` to a recipe for their recompute); ``--rl-train-mb-tokens`` sets the packed
``train_mb_tokens``, ``--rl-packing packed`` leaves the unpacked children out, and ``--profile-dir DIR`` profiles one
more training call per child after the timed ones (``nemo_fp8.utils.profiling``: a table per rank in
``DIR/<shape>-<recipe>-<packed|unpacked>``):

    python tools/bench_train.py --workload rl --shapes dense --tp 2 --rl-packing packed --rl-train-mb-tokens 8192 \
        --recipes bf16@activation_checkpointing=true,e4m3-blockwise@activation_checkpointing=true --profile-dir prof

Recipes: ``bf16``, ``{e4m3,hybrid}-{tensorwise,blockwise}``, suffix ``+param`` for ``fp8_param``,
then any ``@key=value``: a ``policy.megatron_cfg`` key of ours (``bf16@fuse_wgrad_accumulation=false``) or
a ``megatron_cfg.override_transformer_config`` attribute (``e4m3-blockwise@moe_router_padding_for_quantization=true``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lab.host_profile import format_host_profile, host_profile
from lab.random_checkpoint import QWEN3_SHAPES, write_shape_config
from nemo_fp8.policy.spec import PolicySpec

# (shape in lab.random_checkpoint.QWEN3_SHAPES, decoder layers kept)
SHAPES = {"dense": ("qwen3-8b", 8), "moe": ("qwen3-30b-a3b", 4)}


def write_config(kind: str, root: Path) -> Path:
    name, layers = SHAPES[kind]
    return write_shape_config(name, root / kind, layers)


def parse_recipe(name: str) -> tuple[dict | None, dict]:
    """``bf16`` -> (None, {}); ``e4m3-blockwise+param@moe_router_padding_for_quantization=true`` ->
    (fp8_cfg keys, more ``policy.megatron_cfg`` keys). Each ``@key=value`` (the value read as YAML:
    ``true``, ``3``, ``fp32``) sets ``megatron_cfg.<key>`` where that is one of our own keys (e.g.
    ``@fuse_wgrad_accumulation=false``), else one megatron-core ``TransformerConfig`` attribute through
    ``megatron_cfg.override_transformer_config``, so a run can set one knob beside the same recipe without it.

    Raises:
        ValueError: an unknown recipe name or a malformed ``@key=value`` (lists the valid forms).
    """
    import yaml

    from nemo_fp8.policy.config import MegatronConfig

    own = set(MegatronConfig.model_fields) - {"enabled", "fp8_cfg", "override_transformer_config"}
    name, *sets = name.split("@")
    extra_cfg: dict = {}
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key.isidentifier():
            raise ValueError(f"--recipes: {item!r} in {name!r} is not @key=value (a policy.megatron_cfg key or a "
                             "TransformerConfig attribute)")
        if key == "logprob_kernel":  # the columns pick their kernels themselves; the step's is --logprob-kernel
            raise ValueError(f"--recipes: {item!r} in {name!r}: the log-prob kernel is --logprob-kernel, not a recipe")
        target = extra_cfg if key in own else extra_cfg.setdefault("override_transformer_config", {})
        target[key] = yaml.safe_load(value)
    if name == "bf16":
        return None, extra_cfg
    base, _, extra = name.partition("+")
    fp8, _, recipe = base.partition("-")
    if fp8 not in ("e4m3", "hybrid") or recipe not in ("tensorwise", "blockwise") or extra not in ("", "param"):
        raise ValueError(f"--recipes: {name!r} is not bf16 or {{e4m3,hybrid}}-{{tensorwise,blockwise}}[+param]"
                         "[@key=value...]")
    return dict(enabled=True, fp8=fp8, fp8_recipe=recipe, fp8_param=extra == "param"), extra_cfg


def recipe_megatron_cfg(recipe: str, logprob_kernel: str) -> dict:
    """The ``policy.megatron_cfg`` a child runs ``recipe`` with (``parse_recipe``): the megatron backend, the
    recipe's ``fp8_cfg`` (BF16: disabled), ``logprob_kernel`` and the recipe's ``@key=value`` settings. The parent
    validates this same dict before starting any child.

    Raises:
        ValueError: as ``parse_recipe``.
    """
    fp8, extra_cfg = parse_recipe(recipe)
    return {"enabled": True, "fp8_cfg": fp8 or {"enabled": False}, "logprob_kernel": logprob_kernel, **extra_cfg}


def timed_interleaved(fns: dict, steps: int, warmup: int, sync=None) -> dict[str, float]:
    """Median seconds of each of ``fns`` (name -> callable), measured in interleaved rounds.

    Each round runs every callable once, the order rotated by one per round, so that a drift of the GPU's
    clock or temperature during the run falls on every column alike instead of on whichever ran last
    (runs of one column after another differed by up to 5% for the same kernel). ``warmup`` rounds come
    first and are not timed. ``sync`` (default ``torch.cuda.synchronize``) is called before each clock read.

    Returns:
        name -> median seconds over ``steps`` rounds.

    Raises:
        ValueError: ``steps`` < 1 or ``warmup`` < 0.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    if sync is None:
        import torch

        sync = torch.cuda.synchronize
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + steps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            sync()
            t0 = time.perf_counter()
            fns[name]()
            sync()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {n: sorted(t)[len(t) // 2] for n, t in times.items()}


def profile_fb(fn, rounds: int) -> dict:
    """Where one forward + backward's time goes: ``fn`` run ``rounds`` times under ``torch.profiler``.

    Returns:
        ``tools/profile_rollout.summarize``'s ms per round by kernel category (``gemm``, ``moe``,
        ``attention``, ``quant``, ...), ``gpu`` (their sum), ``wall``, ``host`` (wall - gpu: time no
        kernel ran, e.g. the CPU launching kernels), ``top`` (8 longest kernels), and ``launches``:
        CUDA kernels per round.
    """
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from profile_rollout import summarize

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t0 = time.perf_counter()
        for _ in range(rounds):
            fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    cuda = [e for e in p.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    out = summarize([(e.key, float(e.self_device_time_total)) for e in cuda], wall, rounds)
    out["launches"] = sum(e.count for e in cuda) / rounds
    return out


def print_profile(rows: list[dict]) -> None:
    """The ``--profile`` table: ms per forward + backward (``fused`` log-probs) by kernel category."""
    rows = [r for r in rows if "profile" in r]
    if not rows:
        return
    from profile_rollout import CATEGORIES

    keys = list(CATEGORIES) + ["gpu", "host", "wall"]
    print("\nms per forward + backward (fused log-probs) by kernel category, and CUDA kernels launched")
    head = f"{'shape':6} {'recipe':22}" + "".join(f" {k:>9}" for k in keys) + f" {'launches':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        pr = r["profile"]
        print(f"{r['shape']:6} {r['recipe']:22}" + "".join(f" {pr[k]:9.1f}" for k in keys) + f" {pr['launches']:9.0f}")


def raw_fb(model, ids, pos, labels):
    """The ``raw f+b`` callable: megatron-core alone, ``GPTModel(input_ids, position_ids, labels=...)`` with its
    own vocab-parallel cross entropy, ``.mean().backward()`` (``ids``, ``pos``, ``labels``: ``[B, T]`` on the GPU)."""
    def f():
        model.zero_grad_buffer()
        model(input_ids=ids, position_ids=pos, attention_mask=None, labels=labels).float().mean().backward()
    return f


def run_child(a) -> dict:
    """Child: one (shape, recipe); prints one JSON line."""
    import torch

    from nemo_fp8.algorithms.config import ClippedPGLossConfig
    from nemo_fp8.algorithms.loss import ClippedPGLossFn
    from nemo_fp8.batch import TrainBatch
    from nemo_fp8.policy.config import PolicyConfig
    from nemo_fp8.policy.megatron.backend import MegatronPolicyBackend
    from nemo_fp8.policy.megatron.te_model import unwrap

    cfg = PolicyConfig(model_name=a.model, precision="bfloat16", device="cuda",
                       train_global_batch_size=a.batch * a.micro_batches, train_micro_batch_size=a.batch,
                       logprob_batch_size=a.batch, max_total_sequence_length=a.seq_len,
                       megatron_cfg=recipe_megatron_cfg(a.recipe, a.logprob_kernel),
                       generation={"vllm_cfg": {"precision": "fp8"}})
    t0 = time.perf_counter()
    be = MegatronPolicyBackend(PolicySpec.from_config(cfg, torch.device("cuda", 0)), load_weights=False)
    build_s = time.perf_counter() - t0
    vocab = QWEN3_SHAPES[SHAPES[a.shape][0]]["vocab_size"]
    g = torch.Generator().manual_seed(0)
    n = a.batch * a.micro_batches  # the global batch; the first micro-batch is timed alone below
    batch = TrainBatch(token_ids=torch.randint(2, vocab, (n, a.seq_len), generator=g),
                       prompt_lengths=torch.ones(n, dtype=torch.long),
                       response_lengths=torch.full((n,), a.seq_len - 1, dtype=torch.long),
                       advantages=torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0),
                       generation_logprobs=torch.zeros(n, a.seq_len))
    batch.prev_logprobs = be.get_logprobs(batch)
    batch.generation_logprobs = batch.prev_logprobs.clone()
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig())
    model, dev = be.model, be.device
    mb = batch.select(slice(0, a.batch)).to(dev)
    ids_d = mb.token_ids
    pos = torch.arange(a.seq_len, device=dev).expand(a.batch, a.seq_len)
    labels = torch.roll(ids_d, -1, dims=1)
    n_tok = torch.tensor(float(mb.token_mask.sum()), device=dev)
    n_seq = torch.tensor(float(a.batch), device=dev)
    model.train()

    raw = raw_fb(model, ids_d, pos, labels)

    def ours(kernel):
        def f():
            be.cfg.megatron_cfg.logprob_kernel = kernel
            model.zero_grad_buffer()
            loss, _ = loss_fn(be._forward_logprobs(model, mb), mb, n_tok, n_seq)
            loss.backward()
        return f

    # raw and ours reuse TE's cached FP8 weights (the micro-batches after a global batch's first); the full step
    # (be.train) quantizes every weight once per global batch, as megatron-core's schedules do
    fb = timed_interleaved({"raw": raw, **{k: ours(k) for k in ("chunked", "fused", "te")}}, a.steps, a.warmup)
    raw_s, ours_s, fused_s, te_s = fb["raw"], fb["chunked"], fb["fused"], fb["te"]
    be.cfg.megatron_cfg.logprob_kernel = a.logprob_kernel
    step_s = timed_interleaved({"step": lambda: be.train(batch, loss_fn)}, a.steps, a.warmup)["step"] / a.micro_batches
    prof = profile_fb(ours("fused"), a.profile) if a.profile else None
    host = host_profile(ours("fused"), a.host_profile, torch.cuda.synchronize) if a.host_profile else None
    out = dict(shape=a.shape, recipe=a.recipe, raw_ms=raw_s * 1e3, ours_ms=ours_s * 1e3, fused_ms=fused_s * 1e3,
               te_ms=te_s * 1e3, step_ms=step_s * 1e3, micro_batches=a.micro_batches, logprob_kernel=a.logprob_kernel,
               tokens=a.batch * a.seq_len, peak_gib=torch.cuda.max_memory_allocated() / 2**30, build_s=build_s,
               params_b=sum(p.numel() for p in unwrap(model).parameters()) / 1e9)
    if prof:
        out["profile"] = prof
    if host:
        out["host_profile"] = host
    be.shutdown()
    return out


RL_PACKING = dict(enabled=True, algorithm="modified_first_fit_decreasing", train_mb_tokens=4096,
                  logprob_mb_tokens=16384, sequence_length_round=64)  # the 8B configs' values


def rl_policy_cfg(a, recipe: str, packed: bool):
    """The ``PolicyConfig`` of one ``--workload rl`` child (validated: bad packing budgets fail here, in the parent):
    ``--tp`` ranks of tensor parallelism (sequence parallel above 1), one data-parallel rank."""
    from nemo_fp8.policy.config import PolicyConfig

    layout = {"tensor_model_parallel_size": a.tp, "sequence_parallel": a.tp > 1}
    return PolicyConfig(model_name=a.model or "unused", precision="bfloat16", device="cuda",
                        train_global_batch_size=a.rl_responses, train_micro_batch_size=1, logprob_batch_size=2,
                        max_total_sequence_length=a.rl_prompt + a.rl_response_max,
                        megatron_cfg={**layout, **recipe_megatron_cfg(recipe, a.logprob_kernel)},
                        sequence_packing={**RL_PACKING, "enabled": packed, "train_mb_tokens": a.rl_train_mb_tokens},
                        generation={"vllm_cfg": {"precision": "fp8"}},
                        profile={"dir": a.profile_dir, "train_call": a.warmup + a.steps + 1})


def rl_batch(a, vocab: int):
    """``--rl-responses`` rows: a ``--rl-prompt``-token prompt + a uniform ``--rl-response-min..max`` response."""
    import torch

    from nemo_fp8.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    n = a.rl_responses
    resp = torch.randint(a.rl_response_min, a.rl_response_max + 1, (n,), generator=g)
    width = a.rl_prompt + int(resp.max())
    ids = torch.randint(2, vocab, (n, width), generator=g)
    ids[torch.arange(width)[None, :] >= (a.rl_prompt + resp)[:, None]] = 0
    return TrainBatch(token_ids=ids, prompt_lengths=torch.full((n,), a.rl_prompt, dtype=torch.long),
                      response_lengths=resp, advantages=torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0),
                      generation_logprobs=torch.zeros(n, width))


def run_rl_child(a) -> dict:
    """Child of ``--workload rl``: one (shape, recipe, packed); rounds of get_logprobs + train, medians."""
    import torch

    from nemo_fp8.algorithms.config import ClippedPGLossConfig
    from nemo_fp8.algorithms.loss import ClippedPGLossFn
    from nemo_fp8.policy.megatron.backend import MegatronPolicyBackend

    cfg = rl_policy_cfg(a, a.recipe, a.packed)
    rank = int(os.environ.get("RANK", "0"))  # --tp > 1: one of torch.distributed.run's ranks, one GPU each
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    be = MegatronPolicyBackend(PolicySpec.from_config(cfg, device), rank=rank, world_size=a.tp,
                               dist_init_method="env://" if a.tp > 1 else None, load_weights=False)
    batch = rl_batch(a, QWEN3_SHAPES[SHAPES[a.shape][0]]["vocab_size"])
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig())
    lp_s, train_s, metrics = [], [], {}
    for r in range(a.warmup + a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        batch.prev_logprobs = be.get_logprobs(batch)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        batch.generation_logprobs = batch.prev_logprobs.clone()
        metrics = be.train(batch, loss_fn)
        torch.cuda.synchronize()
        if r >= a.warmup:
            lp_s.append(t1 - t0)
            train_s.append(time.perf_counter() - t1)
    if cfg.profile.dir:  # one more call, the profiled one (policy.profile.train_call)
        be.train(batch, loss_fn)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    raw_ms = None
    if a.packed:  # the engine's own ceiling on this GPU, in the same child: one micro-batch of train_mb_tokens tokens
        t = cfg.sequence_packing.train_mb_tokens
        ids = torch.randint(2, QWEN3_SHAPES[SHAPES[a.shape][0]]["vocab_size"], (1, t),
                            generator=torch.Generator().manual_seed(1)).to(be.device)
        be.model.train()
        fn = raw_fb(be.model, ids, torch.arange(t, device=be.device)[None], torch.roll(ids, -1, dims=1))
        raw_ms = timed_interleaved({"raw": fn}, a.steps, a.warmup)["raw"] * 1e3
    out = dict(shape=a.shape, recipe=a.recipe, packed=a.packed, tp=a.tp,
               train_mb_tokens=cfg.sequence_packing.train_mb_tokens, logprobs_s=med(lp_s), train_s=med(train_s),
               raw_ms=raw_ms,
               step_s=med([x + y for x, y in zip(lp_s, train_s)]), micro_batches=metrics.get("micro_batches"),
               packing_efficiency=metrics.get("packing_efficiency"),
               tokens=int((batch.prompt_lengths + batch.response_lengths).sum()),
               peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    be.shutdown()
    return out


def print_rl_table(rows: list[dict]) -> None:
    """The ``--workload rl`` table: one row per (shape, recipe, packed), ratios of step time."""
    key = lambda r, packed: (r["shape"], "bf16", packed)  # noqa: E731
    base = {(r["shape"], r["recipe"], r["packed"]): r for r in rows if "error" not in r}
    head = f"{'shape':6} {'recipe':22} {'packed':>6} {'logprobs s':>10} {'train s':>8} {'step s':>7} " \
           f"{'train mbs':>9} {'pack eff':>8} {'tok/s':>8} {'vs bf16 unpacked':>16} {'vs bf16 packed':>14} " \
           f"{'raw f+b ms':>10} {'raw vs bf16':>11} {'peak GiB':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:6} {r['recipe']:22} {str(r.get('packed')):>6} failed: {r['error']}")
            continue
        ratio = lambda b: f"{b['step_s'] / r['step_s']:.3f}" if b else "-"  # noqa: E731
        b_raw = (base.get(key(r, True)) or {}).get("raw_ms")
        raw, raw_vs = r.get("raw_ms"), "-"
        if raw and b_raw:
            raw_vs = f"{b_raw / raw:.3f}"
        print(f"{r['shape']:6} {r['recipe']:22} {str(r['packed']):>6} {r['logprobs_s']:10.2f} {r['train_s']:8.2f} "
              f"{r['step_s']:7.2f} {r['micro_batches'] or 0:9.0f} {r['packing_efficiency'] or 0:8.3f} "
              f"{r['tokens'] / r['step_s']:8.0f} {ratio(base.get(key(r, False))):>16} "
              f"{ratio(base.get(key(r, True))):>14} {f'{raw:.1f}' if raw else '-':>10} {raw_vs:>11} {r['peak_gib']:8.1f}")


def print_table(rows: list[dict]) -> None:
    base = {r["shape"]: r for r in rows if r["recipe"] == "bf16" and "error" not in r}
    head = f"{'shape':6} {'recipe':22} {'raw f+b ms':>10} {'ours f+b ms':>11} {'ours/raw':>8} {'fused f+b':>9} " \
           f"{'fused/raw':>9} {'te f+b ms':>9} {'te/raw':>6} {'step ms':>8} {'tok/s':>8} {'vs bf16':>8} " \
           f"{'fused vs bf16':>13} {'raw vs bf16':>11} {'peak GiB':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:6} {r['recipe']:22} failed: {r['error']}")
            continue
        b = base.get(r["shape"])
        tps = r["tokens"] / r["step_ms"] * 1e3
        vs = f"{b['step_ms'] / r['step_ms']:.3f}" if b else "-"
        raw_vs = f"{b['raw_ms'] / r['raw_ms']:.3f}" if b else "-"
        fused_vs = f"{b['fused_ms'] / r['fused_ms']:.3f}" if b else "-"
        print(f"{r['shape']:6} {r['recipe']:22} {r['raw_ms']:10.1f} {r['ours_ms']:11.1f} {r['ours_ms'] / r['raw_ms']:8.3f} "
              f"{r['fused_ms']:9.1f} {r['fused_ms'] / r['raw_ms']:9.3f} {r['te_ms']:9.1f} {r['te_ms'] / r['raw_ms']:6.3f} "
              f"{r['step_ms']:8.1f} {tps:8.0f} {vs:>8} {fused_vs:>13} {raw_vs:>11} "
              f"{r['peak_gib']:8.1f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="dense,moe")
    p.add_argument("--recipes", default="bf16,e4m3-tensorwise,hybrid-tensorwise,e4m3-blockwise")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batches", type=int, default=16,
                   help="micro-batches per optimizer step (step column; the 8B configs have 512 of 1 x 4096 tokens)")
    p.add_argument("--logprob-kernel", choices=["chunked", "fused", "te"], default="fused",
                   help="megatron_cfg.logprob_kernel of the step column (the megatron example configs' kernel)")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=int, default=300, help="seconds per child")
    p.add_argument("--profile", type=int, default=0, metavar="ROUNDS",
                   help="also profile ROUNDS forward+backward passes (fused log-probs): ms by kernel category")
    p.add_argument("--host-profile", type=int, default=0, metavar="ROUNDS",
                   help="also run ROUNDS fused forward+backward passes under cProfile: the host's ms by library "
                        "part and the top functions (tools/lab/host_profile.py)")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--workload", choices=["fixed", "rl"], default="fixed",
                   help="fixed: micro-batches of --batch x --seq-len; rl: a GRPO step's spread of lengths, packed "
                        "and unpacked (module docstring)")
    p.add_argument("--rl-responses", type=int, default=64)
    p.add_argument("--rl-prompt", type=int, default=512)
    p.add_argument("--rl-response-min", type=int, default=256)
    p.add_argument("--rl-response-max", type=int, default=3072)
    p.add_argument("--rl-train-mb-tokens", type=int, default=RL_PACKING["train_mb_tokens"],
                   help="packed children's policy.sequence_packing.train_mb_tokens (%(default)s)")
    p.add_argument("--rl-packing", choices=["both", "packed"], default="both",
                   help="rl children: unpacked and packed (both) or packed only")
    p.add_argument("--tp", type=int, default=1,
                   help="rl children: tensor-parallel ranks (GPUs) each, with sequence parallelism")
    p.add_argument("--profile-dir", help="rl children: profile one more training call into DIR/<child>")
    p.add_argument("--packed", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--recipe", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.micro_batches < 1:
        p.error(f"--micro-batches must be >= 1, got {a.micro_batches}")
    if a.child:
        out = run_rl_child(a) if a.workload == "rl" else run_child(a)
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(out), flush=True)
        return 0
    if a.workload != "rl" and (a.tp != 1 or a.profile_dir):
        p.error("--tp and --profile-dir are options of --workload rl")
    if a.tp < 1:
        p.error(f"--tp must be >= 1, got {a.tp}")
    recipes = a.recipes.split(",")
    from nemo_fp8.policy.config import MegatronConfig

    if a.workload == "rl" and not 1 <= a.rl_response_min <= a.rl_response_max:
        p.error(f"--rl-response-min/max: need 1 <= min <= max, got {a.rl_response_min}, {a.rl_response_max}")
    for r in recipes:  # bad names and bad megatron_cfg values (and packing budgets) fail before any GPU work
        try:
            MegatronConfig(**recipe_megatron_cfg(r, a.logprob_kernel))
            if a.workload == "rl":
                rl_policy_cfg(a, r, packed=True)
        except ValueError as e:  # pydantic's ValidationError is a ValueError
            p.error(f"--recipes {r}: {e}")
    unknown = [s for s in a.shapes.split(",") if s not in SHAPES]
    if unknown:
        p.error(f"--shapes: unknown {unknown}; valid: {sorted(SHAPES)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in a.shapes.split(","):
            model = write_config(shape, Path(tmp))
            layouts = {"both": (False, True), "packed": (True,)}[a.rl_packing] if a.workload == "rl" else (False,)
            for recipe, packed in [(r, pk) for r in recipes for pk in layouts]:
                launch = [sys.executable] if a.tp == 1 else [  # rank 0's output only: it prints the row
                    sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.tp}",
                    "--local-ranks-filter=0"]
                cmd = launch + [__file__, "--child", "--shape", shape, "--recipe", recipe, "--model", str(model),
                       "--batch", str(a.batch), "--seq-len", str(a.seq_len), "--steps", str(a.steps),
                       "--warmup", str(a.warmup), "--micro-batches", str(a.micro_batches),
                       "--logprob-kernel", a.logprob_kernel, "--profile", str(a.profile),
                       "--host-profile", str(a.host_profile), "--workload", a.workload,
                       "--rl-responses", str(a.rl_responses), "--rl-prompt", str(a.rl_prompt),
                       "--rl-response-min", str(a.rl_response_min), "--rl-response-max", str(a.rl_response_max),
                       "--rl-train-mb-tokens", str(a.rl_train_mb_tokens), "--tp", str(a.tp)]
                cmd += ["--packed"] if packed else []
                if a.profile_dir:  # the child's policy.profile.dir
                    name = f"{shape}-{recipe}-{'packed' if packed else 'unpacked'}".replace("@", "_").replace("=", "-")
                    cmd += ["--profile-dir", str(Path(a.profile_dir) / name)]
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
                    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                    if line:
                        rows.append(json.loads(line[-1][7:]))
                    else:
                        lines = (proc.stderr or proc.stdout).strip().splitlines()
                        # torch.distributed.run ends with its own summary: the rank's exception line tells more
                        errors = [x for x in lines
                                  if ("Error: " in x or "Exception: " in x) and "ChildFailedError" not in x]
                        tail = errors[-1:] if a.tp > 1 and errors else lines[-3:]
                        rows.append(dict(shape=shape, recipe=recipe, packed=packed, error=" | ".join(tail)[-400:]))
                except subprocess.TimeoutExpired:
                    rows.append(dict(shape=shape, recipe=recipe, packed=packed, error=f"timeout {a.timeout}s"))
                print(f"# {shape} {recipe}: {rows[-1]}", file=sys.stderr, flush=True)
    if a.workload == "rl":
        print(f"bench_train --workload rl: {a.rl_responses} sequences of {a.rl_prompt} prompt + "
              f"{a.rl_response_min}..{a.rl_response_max} response tokens, one step = get_logprobs + train (one "
              f"optimizer step, {a.logprob_kernel} log-probs), median of {a.steps} after {a.warmup} warm-up; "
              f"tensor parallel {a.tp}{' + sequence parallel' if a.tp > 1 else ''}, packed train_mb_tokens "
              f"{a.rl_train_mb_tokens}")
        print_rl_table(rows)
    else:
        print(f"bench_train: {a.batch} x {a.seq_len} tokens per micro-batch, {a.micro_batches} micro-batches per "
              f"optimizer step (step: {a.logprob_kernel} log-probs), median of {a.steps} after {a.warmup} warm-up")
        print_table(rows)
        print_profile(rows)
        for r in rows:
            if "host_profile" in r:
                print("\n" + format_host_profile(f"{r['shape']} {r['recipe']}", r["host_profile"], r["fused_ms"]))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
