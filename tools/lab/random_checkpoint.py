"""Qwen3-shaped HF checkpoints with random bf16 weights, written shard by shard (bounded host memory).

The real Qwen3-8B / Qwen3-30B-A3B are one path change away (``policy.model_name``); these stand in for
them where no model hub can be reached. Tensor names and shapes are those of the published
checkpoints (per-expert MoE weights ``mlp.experts.{e}.{gate,up,down}_proj.weight``), so vLLM,
Megatron-Bridge and ``transformers`` load them like the real ones. The vocabulary is Qwen3's 151,936
rows; the tokenizer saved beside them may be smaller (the project's BPE one): token ids past the
tokenizer are valid model outputs that decode to nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch

QWEN3_SHAPES: dict[str, dict] = {
    "qwen3-8b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16"),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, torch_dtype="bfloat16"),
}
INIT_STD = 0.02


def write_shape_config(shape: str, out_dir: str | Path, num_layers: int = 0) -> Path:
    """Save the HF ``config.json`` of ``QWEN3_SHAPES[shape]`` (``num_layers`` > 0: cut to that many
    decoder layers) in ``out_dir``: what the benchmarks build dummy / random-weight models from.

    Raises:
        KeyError: an unknown shape (the message lists the valid ones).
    """
    from transformers import AutoConfig

    if shape not in QWEN3_SHAPES:
        raise KeyError(f"unknown shape {shape!r}; valid: {sorted(QWEN3_SHAPES)}")
    cfg = dict(QWEN3_SHAPES[shape])
    if num_layers:
        cfg["num_hidden_layers"] = num_layers
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    AutoConfig.for_model(**cfg).save_pretrained(str(out_dir))
    return out_dir


def tensor_plan(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every weight of a Qwen3 / Qwen3-MoE checkpoint described by ``cfg``, in file order.

    Args:
        cfg: a config dict with ``model_type`` ``qwen3`` or ``qwen3_moe`` and the usual size keys.

    Raises:
        ValueError: another ``model_type``, or a key the shapes need is missing.
    """
    mt = cfg.get("model_type")
    if mt not in ("qwen3", "qwen3_moe"):
        raise ValueError(f"model_type {mt!r} not supported (valid: qwen3, qwen3_moe)")
    need = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "vocab_size", "intermediate_size"]
    need += ["moe_intermediate_size", "num_experts"] if mt == "qwen3_moe" else []
    missing = [k for k in need if k not in cfg]
    if missing:
        raise ValueError(f"config lacks {missing}")
    h, hd, v = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    plan = [("model.embed_tokens.weight", (v, h))]
    sparse_step = cfg.get("decoder_sparse_step", 1)
    dense_layers = set(cfg.get("mlp_only_layers") or [])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        plan += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                 (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                 (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                 (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        moe = mt == "qwen3_moe" and i not in dense_layers and cfg["num_experts"] > 0 and (i + 1) % sparse_step == 0
        if moe:
            e_int = cfg["moe_intermediate_size"]
            plan.append((p + "mlp.gate.weight", (cfg["num_experts"], h)))
            for e in range(cfg["num_experts"]):
                pe = f"{p}mlp.experts.{e}."
                plan += [(pe + "gate_proj.weight", (e_int, h)), (pe + "up_proj.weight", (e_int, h)),
                         (pe + "down_proj.weight", (h, e_int))]
        else:
            inter = cfg["intermediate_size"]
            plan += [(p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                     (p + "mlp.down_proj.weight", (h, inter))]
    plan.append(("model.norm.weight", (h,)))
    if not cfg.get("tie_word_embeddings", False):
        plan.append(("lm_head.weight", (v, h)))
    return plan


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def shard_plan(plan: list[tuple[str, tuple[int, ...]]], max_shard_bytes: int,
               bytes_per_element: int = 2) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Split ``plan`` in order into shards of at most ``max_shard_bytes`` (a larger tensor gets a shard alone).

    Raises:
        ValueError: ``max_shard_bytes`` <= 0.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    shards: list[list] = [[]]
    size = 0
    for name, shape in plan:
        b = _numel(shape) * bytes_per_element
        if shards[-1] and size + b > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += b
    return shards


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """bf16 init of one weight: norms are ones, everything else N(0, 0.02^2)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    return torch.randn(shape, generator=generator, dtype=torch.float32).mul_(INIT_STD).to(torch.bfloat16)


def iter_random_shards(cfg: dict, max_shard_bytes: int, seed: int = 0
                       ) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
    """Yield ``(index, count, {name: bf16 tensor})`` per shard; only one shard's tensors are alive at a time.

    Shard ``i`` draws from a generator seeded with ``seed * 1_000_003 + i`` (reproducible per shard).
    """
    shards = shard_plan(tensor_plan(cfg), max_shard_bytes)
    for i, shard in enumerate(shards):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        yield i, len(shards), {name: random_tensor(name, shape, g) for name, shape in shard}


def write_random_checkpoint(out_dir: str | Path, cfg: dict, tokenizer, max_shard_gib: float = 4.0,
                            seed: int = 0, progress: bool = True) -> dict:
    """Write an HF checkpoint of ``cfg``'s shape with random bf16 weights, shard by shard, plus ``tokenizer``.

    Files: ``config.json`` (token ids from ``tokenizer``), ``generation_config.json``,
    ``model-0000i-of-0000N.safetensors``, ``model.safetensors.index.json``, the tokenizer files, and
    ``random_checkpoint.json`` (shape name, parameters, bytes, seconds). Peak host memory is about
    one shard (``max_shard_gib``) plus one tensor.

    Args:
        out_dir: output folder; must not exist (written into ``<out_dir>.tmp``, renamed at the end).
        cfg: config dict, e.g. ``QWEN3_SHAPES["qwen3-8b"]`` (possibly with fewer layers).
        tokenizer: an HF tokenizer whose size is <= ``cfg["vocab_size"]``.
        max_shard_gib: shard size bound in GiB (> 0).
        seed: weights are a function of (seed, shard layout).

    Returns:
        dict: the report written to ``random_checkpoint.json``.

    Raises:
        FileExistsError: ``out_dir`` exists. ValueError: bad config (:func:`tensor_plan`), a tokenizer
        larger than the vocabulary, or ``max_shard_gib`` <= 0.
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig

    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; remove it or pick another folder")
    if max_shard_gib <= 0:
        raise ValueError(f"max_shard_gib must be > 0, got {max_shard_gib}")
    if len(tokenizer) > cfg["vocab_size"]:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens > vocab_size={cfg['vocab_size']}")
    plan = tensor_plan(cfg)
    t0 = time.perf_counter()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    for old in tmp.glob("model-*.safetensors"):  # a previous interrupted attempt
        old.unlink()
    ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items()}, **ids)
    config.save_pretrained(tmp)
    GenerationConfig(**ids).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    weight_map, total = {}, 0
    for i, n, tensors in iter_random_shards(cfg, int(max_shard_gib * 2**30), seed):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        del tensors
        if progress:
            print(f"[random-ckpt] shard {i + 1}/{n} written ({total / 2**30:.1f} GiB so far, "
                  f"{time.perf_counter() - t0:.0f} s)", flush=True)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2))
    report = {"model_type": cfg["model_type"], "parameters": sum(_numel(s) for _, s in plan), "bytes": total,
              "shards": len(set(weight_map.values())), "tokenizer_vocab": len(tokenizer),
              "vocab_size": cfg["vocab_size"], "seed": seed, "seconds": round(time.perf_counter() - t0, 1),
              "config": cfg}
    (tmp / "random_checkpoint.json").write_text(json.dumps(report, indent=2))
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} appeared while the checkpoint was being written; not overwriting it")
    tmp.rename(out_dir)
    return report
