"""The SGLang refit's data: flattened buckets, KV-scale rules, completeness (pure torch: imports no SGLang).

Conversion. The trainer's ``(HF name, high-precision tensor)`` become what an FP8 block checkpoint holds, by the
same ``RefitPlan.convert`` as the vLLM engine (``nemo_fp8.generation.vllm.refit``, pure torch: the quantizer is
``quantize_blockwise_gpu``, bit-identical to ``nemo_fp8.fp8.quantize.quantize_weight_blockwise``): an FP8 Linear's
``<m>.weight`` [N, K] -> ``<m>.weight`` e4m3 [N, K] + ``<m>.weight_scale_inv`` fp32 [ceil(N/128), ceil(K/128)]
(power-of-two scales with ``pow2_weight_scaling_factors``), fused MoE experts per expert, the rest bf16. SGLang's
``Qwen3ForCausalLM.load_weights`` (``srt/models/qwen3.py``; Qwen2 and Llama load alike) maps those checkpoint names
onto its fused ``qkv_proj`` / ``gate_up_proj`` shards itself.

KV scales. SGLang's FP8 KV cache keeps two scales per layer, ``RadixAttention.k_scale`` / ``v_scale``
(``srt/layers/quantization/kv_cache.py``), loaded from the checkpoint names ``model.layers.{i}.self_attn.k_scale`` /
``v_scale`` (``maybe_remap_kv_scale_name`` in ``srt/model_loader/weight_utils.py`` maps them to
``...self_attn.attn.k_scale``): exactly the names of ``nemo_fp8.fp8.kv_scales``. It has no q scale: FA3 casts q to
e4m3 unscaled (``flashattention_backend.py``: ``q.to(self.kv_cache_dtype)``), so the calibration's ``q_scale`` has
no engine counterpart and is not sent (the torch reference's q fake-quantization then differs from this engine's: one
more rollout/trainer mismatch the IS correction covers). ``check_kv_scale`` refuses a scale that is not one finite
positive number before anything is sent: SGLang would store K/V divided by it.

Flattened buckets (``load_format="flattened_bucket"`` of ``Engine.update_weights_from_tensor``): one uint8 buffer per
bucket and, per tensor, ``(name, shape, dtype, start_idx, end_idx, numel)`` with ``numel`` counting bytes, the fields
of SGLang's ``FlattenedTensorMetadata`` (``srt/weight_sync/tensor_bucket.py``), whose receiver views
``buffer[start_idx:end_idx].view(dtype).reshape(shape)`` (``FlattenedTensorBucket.reconstruct_tensors``). SGLang's own
packer concatenates without gaps; here each tensor starts at a multiple of 16 bytes, so every view is aligned for its
dtype whatever precedes it (an odd-sized e4m3 tensor before an fp32 scale would otherwise make the view illegal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch
from torch import Tensor

from nemo_fp8.distributed.weight_sync import iter_buckets
from nemo_fp8.fp8.kv_scales import KV_SCALE_NAME, is_kv_scale_name, parse_kv_scale_name

ALIGN = 16  # bytes: each tensor of a flattened bucket starts at a multiple
SGLANG_KV_KINDS = ("k", "v")  # the per-layer KV scales SGLang 0.5.17 has (no q scale)
DEFAULT_BUCKET_BYTES = 1 << 30


@dataclass(frozen=True)
class FlatEntry:
    """One tensor of a flattened bucket: SGLang's ``FlattenedTensorMetadata`` fields (byte offsets, ``numel`` in
    bytes)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass
class FlatBucket:
    """A bucket as one byte buffer (``buffer``: [nbytes] uint8, on the tensors' device) and its ``entries``."""

    buffer: Tensor
    entries: list[FlatEntry]

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())


def pack_flat_bucket(items: list[tuple[str, Tensor]]) -> FlatBucket:
    """Copy ``items`` into one uint8 buffer on the first tensor's device, each at a 16-byte-aligned offset.

    Args:
        items: ``(name, tensor)``, any shapes (0-dim included) and dtypes, all on one device.

    Returns:
        ``FlatBucket`` whose ``unpack_flat_bucket`` gives the tensors back bit for bit.

    Raises:
        ValueError: no items, or tensors on more than one device.
    """
    if not items:
        raise ValueError("pack_flat_bucket: an empty bucket")
    devices = {t.device for _, t in items}
    if len(devices) != 1:
        raise ValueError(f"pack_flat_bucket: tensors on {sorted(map(str, devices))}; one bucket lives on one device")
    entries, offset = [], 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        entries.append(FlatEntry(name, tuple(t.shape), t.dtype, offset, offset + nbytes, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    buffer = torch.zeros(offset, dtype=torch.uint8, device=devices.pop())
    for (_, t), e in zip(items, entries):
        buffer[e.start_idx:e.end_idx].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return FlatBucket(buffer, entries)


def unpack_flat_bucket(bucket: FlatBucket) -> list[tuple[str, Tensor]]:
    """Views of ``bucket.buffer`` as its tensors, as SGLang's receiver makes them
    (``FlattenedTensorBucket.reconstruct_tensors``: slice, ``view(dtype)``, ``reshape(shape)``).

    Raises:
        ValueError: an entry outside the buffer, or whose byte count does not fit its shape and dtype.
    """
    out = []
    for e in bucket.entries:
        want = math.prod(e.shape) * torch.empty((), dtype=e.dtype).element_size()
        if e.end_idx > bucket.nbytes or e.end_idx - e.start_idx != e.numel or e.numel != want:
            raise ValueError(f"flattened bucket entry {e.name}: bytes [{e.start_idx}, {e.end_idx}) of a "
                             f"{bucket.nbytes}-byte buffer do not hold {e.dtype}{list(e.shape)} ({want} bytes)")
        out.append((e.name, bucket.buffer[e.start_idx:e.end_idx].view(e.dtype).reshape(e.shape)))
    return out


def _pack_and_clear(items: list[tuple[str, Tensor]]) -> FlatBucket:
    """``pack_flat_bucket(items)``, then ``items`` emptied: the converted tensors are freed once packed (a generator
    suspended at ``yield`` would otherwise keep them alive beside the packed copy)."""
    bucket = pack_flat_bucket(items)
    items.clear()
    return bucket


def flat_buckets(converted: Iterable[tuple[str, Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
                 ) -> Iterator[FlatBucket]:
    """Pack a stream of converted tensors into buckets of at most ``bucket_bytes`` (a larger tensor alone), in order.

    Raises:
        ValueError: ``bucket_bytes <= 0``.
    """
    aligned = lambda t: -(-t.numel() * t.element_size() // ALIGN) * ALIGN  # noqa: E731  (pack_flat_bucket's layout)
    for items in iter_buckets(converted, bucket_bytes, nbytes=aligned):
        yield _pack_and_clear(items)


def check_kv_scale(name: str, tensor: Tensor) -> None:
    """Refuse a KV scale SGLang must not get: not one finite number > 0.

    Raises:
        ValueError: naming the scale and its value (SGLang stores K/V divided by it, so zero, negative or NaN
            would corrupt the cache silently).
    """
    if tensor.numel() != 1:
        raise ValueError(f"KV scale {name}: one value per layer and tensor, got shape {list(tensor.shape)}")
    value = float(tensor.detach().reshape(()).float())
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"KV scale {name} = {value}: FP8 KV scales must be finite and > 0 (amax * margin / 448); "
                         "the refit is refused before anything is sent")


def sent_kv_scale(name: str) -> bool:
    """True for the KV-scale names SGLang loads (``k``/``v``), False for a ``q_scale`` (dropped) and weights."""
    return is_kv_scale_name(name) and parse_kv_scale_name(name)[1] in SGLANG_KV_KINDS


def kv_scale_names(num_layers: int) -> set[str]:
    """``model.layers.{i}.self_attn.{k,v}_scale`` of every layer: what a refit of an FP8 KV engine carries."""
    return {KV_SCALE_NAME.format(layer=i, kind=k) for i in range(num_layers) for k in SGLANG_KV_KINDS}


@dataclass
class RefitLedger:
    """What one refit has sent so far.

    Attributes:
        version: the policy version (GRPO step) being refit.
        weights: canonical HF names of the weights sent (``RefitPlan.checked_names``).
        kv_scales: the ``k``/``v`` scale names sent.
        tensors: converted tensors sent (weights, ``weight_scale_inv``, scales).
    """

    version: int
    weights: set[str] = field(default_factory=set)
    kv_scales: set[str] = field(default_factory=set)
    tensors: int = 0


def refit_problem(expected: Optional[set[str]], ledger: RefitLedger, num_layers: int, kv_fp8: bool,
                  require_kv_scales: bool) -> Optional[str]:
    """Why the refit in ``ledger`` must not be served, or None.

    Args:
        expected: the HF weight names a complete refit holds (``RefitPlan.expected``; None: not checked).
        ledger: what was sent.
        num_layers: decoder layers.
        kv_fp8: the engine runs an FP8 KV cache.
        require_kv_scales: refuse an FP8 KV refit without scales (False only for the engine's initial load).

    Returns:
        a sentence naming the version and what is missing: weights that did not arrive (the engine would mix two
        policy versions), KV scales for only some (layer, k/v) pairs, or none with an FP8 KV cache (the engine
        would keep the previous step's, or garbage after a release of its weights).
    """
    v = ledger.version
    missing = sorted(expected - ledger.weights) if expected is not None else []
    if missing:
        return (f"refit to version {v}: {len(missing)} weights did not arrive (e.g. {missing[:3]}); the engine would "
                "mix two policy versions")
    want = kv_scale_names(num_layers)
    got = ledger.kv_scales
    if got and got != want:
        lacking = sorted(want - got, key=parse_kv_scale_name)
        extra = sorted(got - want, key=parse_kv_scale_name)
        return (f"refit to version {v}: KV scales for {len(got & want)} of {len(want)} (layer, k/v) pairs (missing "
                f"e.g. {lacking[:3]}, unknown layers e.g. {extra[:3]}); send all, or the engine would mix two steps' "
                "scales")
    if kv_fp8 and require_kv_scales and not got:
        return (f"refit to version {v}: kv_cache_dtype='fp8' but no KV scales "
                "(model.layers.<i>.self_attn.{k,v}_scale) were sent; SGLang keeps whatever its k_scale/v_scale parameters hold (the previous step's, or "
                "garbage after its weights' memory was released)")
    return None
