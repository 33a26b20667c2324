"""Refit of the vLLM FP8 engine: HF-named high-precision tensors -> vLLM checkpoint format.

The trainer (or ``VllmGenerationBackend.update_weights``) hands over ``(HF name, tensor)``;
``RefitPlan.convert`` turns them into what vLLM's layerwise reload expects from an FP8 block
checkpoint:

* FP8 Linear ``<m>.weight`` -> ``<m>.weight`` (e4m3) + ``<m>.weight_scale_inv`` (fp32,
  [ceil(N/128), ceil(K/128)]), quantized on the GPU (``quantize_blockwise_gpu``), so half the
  bytes of bf16 cross the process boundary;
* transformers-5 fused MoE experts ``<l>.mlp.experts.gate_up_proj`` [E, 2I, H] /
  ``down_proj`` [E, H, I] (a model in memory) -> per-expert
  ``<l>.mlp.experts.{e}.{gate,up,down}_proj.weight`` (+ scales when the layer is FP8), the names
  vLLM's FusedMoE loader maps; per-expert tensors (HF checkpoints on disk, which transformers 5
  still writes per expert, and Megatron-Bridge's ``export_hf_weights``) keep their names and are
  quantized the same way;
* FP8 KV scales ``model.layers.{i}.self_attn.{q,k,v}_scale`` -> fp32 scalars, unchanged;
* everything else -> bf16 (the engine's dtype).

Transports (``send_weights``): CUDA IPC when trainer and engine share the GPU (the update info of vLLM
0.22's ``IPCWeightTransferEngine``, handed to ``LLM.update_weights`` per bucket), NCCL broadcast when not
(``NCCLWeightTransferEngine``: once, the trainer's ``nccl_trainer_init`` and the engine's
``LLM.init_weight_transfer_engine(nccl_init_info(...))`` form one group, trainer rank 0 and the engine's
workers ranks 1..n; then ``send_weights_nccl`` per bucket, the engine side told names/dtypes/shapes first).
Both are bracketed by ``start_weight_update`` / ``finish_weight_update``, which run vLLM's layerwise reload:
weights are loaded in place (data pointers unchanged, CUDA graphs stay valid).

vLLM 0.22's IPC engine gives each worker the handle keyed by its own GPU's UUID (``receive_weights``). A
tensor-parallel engine (``send_weights_ipc(..., devices=[cuda:0, ..., cuda:n-1])``, the GPUs of its n workers
as the sending process sees them): every worker loads the FULL tensor and keeps its shard (the model's
``load_weights``). So each converted tensor is copied to every device and one update carries, per tensor, a
``{uuid: rebuild args}`` dict with all n GPUs (``merge_ipc_handles``): what vLLM's own multi-rank trainer path
builds with an all-gather. That path (``IPCWeightTransferEngine.trainer_send_weights``) is not used, for one GPU
either: in a process with a ``torch.distributed`` group of several ranks (every data-parallel policy rank) it
all-gathers the handles and only rank 0 sends, so with one engine per rank only engine 0 would be refit.
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import Tensor

from nemo_fp8.fp8.kv_scales import is_kv_scale_name

_FUSED_EXPERTS_RE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
DEFAULT_BUCKET_BYTES = 1 << 30
# A packed bucket's buffer is at least this large: more than a page of the allocator's expandable large segments
# (20 MiB), so it is never carved from a cached remnant beside a live tensor in one of them, which a legacy CUDA IPC
# handle cannot share (policy.megatron_cfg.train_expandable_segments: the trainer trains in such segments)
PACKED_MIN_BUFFER_BYTES = 32 << 20


@dataclass
class RefitPlan:
    """Which HF tensors become FP8 in the engine, and how (pure: no vLLM).

    Attributes:
        fp8_modules: HF Linear module names in FP8 (``plan_layer_precision().fp8_modules``).
        fp8_expert_containers: ``...mlp.experts`` containers whose (fused) experts are FP8.
        scale_mode: "fp32" or "pow2" (``pow2_weight_scaling_factors``).
        expected: HF names a complete refit must contain, MoE experts per expert
            (``canonical_names``; None: not checked).
        dtype: dtype of high-precision tensors in the engine.
        num_experts: ``...mlp.experts`` container -> its number of experts.
        tensors: HF name -> (shape, dtype) of every tensor of the model's state dict (``build_refit_plan``; empty:
            not known), what ``converted_shapes`` converts.
    """

    fp8_modules: set[str]
    fp8_expert_containers: set[str] = field(default_factory=set)
    scale_mode: str = "fp32"
    expected: Optional[set[str]] = None
    dtype: torch.dtype = torch.bfloat16
    num_experts: dict[str, int] = field(default_factory=dict)
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)

    def is_fp8_weight(self, name: str) -> bool:
        """True for the weight of an FP8 Linear or of one expert of an FP8 experts container."""
        m = _EXPERT_RE.match(name)
        if m is not None:
            return m.group("prefix") in self.fp8_expert_containers
        return name.endswith(".weight") and name[: -len(".weight")] in self.fp8_modules

    def canonical_names(self, name: str) -> list[str]:
        """The per-expert HF names a tensor covers: a fused ``...experts.gate_up_proj`` /
        ``down_proj`` covers ``...experts.{e}.{gate,up|down}_proj.weight`` for every expert; any
        other name covers itself. ``expected`` holds these, so fused (a transformers-5 model in
        memory) and per-expert (checkpoints, Megatron-Bridge) refits are checked alike."""
        m = _FUSED_EXPERTS_RE.match(name)
        if m is None or m.group("prefix") not in self.num_experts:
            return [name]
        projs = ("gate_proj", "up_proj") if m.group("kind") == "gate_up_proj" else ("down_proj",)
        return [f"{m.group('prefix')}.{e}.{p}.weight" for e in range(self.num_experts[m.group("prefix")]) for p in projs]

    def checked_names(self, names: Iterable[str]) -> list[str]:
        """The canonical names of HF tensor ``names`` (``canonical_names``), checked against ``expected``.

        Raises:
            KeyError: a name the generation model has no weight for (KV scale names pass).
        """
        out = [c for n in names for c in self.canonical_names(n)]
        if self.expected is not None:
            unknown = [n for n in out if n not in self.expected and not is_kv_scale_name(n)]
            if unknown:
                raise KeyError(f"refit: the generation model has no weight {unknown[0]!r} "
                               f"(e.g. {sorted(self.expected)[:3]})")
        return out

    def _quant(self, name: str, w: Tensor) -> Iterator[tuple[str, Tensor]]:
        from nemo_fp8.generation.vllm.quantize_gpu import quantize_blockwise_gpu

        q, s = quantize_blockwise_gpu(w, self.scale_mode)
        yield name, q
        yield scale_inv_name(name), s

    def conversions(self, name: str, tensor: Tensor, device: Optional[torch.device] = None
                    ) -> Iterator[tuple[str, Tensor, str]]:
        """What ``convert`` makes of one HF tensor, before any of it is computed: ``(checkpoint name, source, how)``
        with ``source`` a view of ``tensor`` (on ``device``) and ``how`` one of ``"scalar"`` (an fp32 scalar: FP8 KV
        scales), ``"fp8"`` (blockwise e4m3 + ``scale_inv_name(name)``, ``quantize_blockwise_gpu``) or ``"cast"``
        (``self.dtype``). The in-place packing (``packed_in_place``) writes these into its buckets itself."""
        t = tensor.detach()
        if device is not None and t.device != device:
            t = t.to(device, non_blocking=True)
        if is_kv_scale_name(name):
            yield name, t, "scalar"
            return
        m = _FUSED_EXPERTS_RE.match(name)
        if m is not None and t.dim() == 3:
            prefix, fp8 = m.group("prefix"), m.group("prefix") in self.fp8_expert_containers
            if m.group("kind") == "gate_up_proj":
                inter = t.shape[1] // 2
                parts = (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter)))
            else:
                parts = (("down_proj", slice(None)),)
            for e in range(t.shape[0]):
                for proj, rows in parts:
                    yield f"{prefix}.{e}.{proj}.weight", t[e, rows], "fp8" if fp8 else "cast"
            return
        yield name, t, "fp8" if self.is_fp8_weight(name) else "cast"

    def convert(self, name: str, tensor: Tensor, device: Optional[torch.device] = None) -> Iterator[tuple[str, Tensor]]:
        """vLLM checkpoint-format tensors for one HF tensor (see the module docstring)."""
        for out, t, how in self.conversions(name, tensor, device):
            if how == "scalar":
                yield out, t.to(torch.float32).reshape(())
            elif how == "fp8":
                yield from self._quant(out, t)
            else:
                yield out, t.to(self.dtype).contiguous()

    def convert_all(self, named_tensors: Iterable[tuple[str, Tensor]], device: Optional[torch.device] = None
                    ) -> Iterator[tuple[str, Tensor]]:
        for name, t in named_tensors:
            yield from self.convert(name, t, device)

    def converted_meta(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[str, str, list[int]]]:
        """(name, dtype name, shape) of what ``convert`` yields, without data (NCCL needs it first)."""
        out = []
        meta = torch.empty(shape, dtype=dtype, device="meta")
        if is_kv_scale_name(name):
            return [(name, "float32", [])]
        m = _FUSED_EXPERTS_RE.match(name)
        if m is not None and len(shape) == 3:
            fp8 = m.group("prefix") in self.fp8_expert_containers
            projs = (("gate_proj", shape[1] // 2), ("up_proj", shape[1] // 2)) if m.group("kind") == "gate_up_proj" \
                else (("down_proj", shape[1]),)
            for e in range(shape[0]):
                for proj, rows in projs:
                    out += _weight_meta(f"{m.group('prefix')}.{e}.{proj}.weight", [rows, shape[2]], fp8, self.dtype)
            return out
        return _weight_meta(name, list(meta.shape), self.is_fp8_weight(name), self.dtype)

    def converted_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of each tensor a refit of all of ``tensors`` sends (``converted_meta``: FP8 weights with their
        ``weight_scale_inv``, fused experts per expert)."""
        return {n: tuple(shape) for name, (shape, dtype) in self.tensors.items()
                for n, _, shape in self.converted_meta(name, shape, dtype)}


def scale_inv_name(weight_name: str) -> str:
    """``<m>.weight`` -> ``<m>.weight_scale_inv``, the name of an FP8 weight's block scales."""
    return weight_name[: -len("weight")] + "weight_scale_inv"


def _weight_meta(name: str, shape: list[int], fp8: bool, dtype: torch.dtype) -> list[tuple[str, str, list[int]]]:
    if not fp8:
        return [(name, str(dtype).split(".")[-1], shape)]
    return [(name, "float8_e4m3fn", shape),
            (scale_inv_name(name), "float32", [math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)])]


def layer_index(name: str) -> Optional[int]:
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def meta_model(model_config: Any):
    """An HF model on the meta device (no memory) for ``model_config``: a PretrainedConfig,
    a dict with ``model_type``, or a local checkpoint folder. The refit plan and the engine arguments read the
    module tree from it (``build_refit_plan``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    if isinstance(model_config, dict):
        model_config = AutoConfig.for_model(**model_config)
    elif not isinstance(model_config, PretrainedConfig):
        model_config = AutoConfig.from_pretrained(str(model_config))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config)


def build_refit_plan(vllm_cfg, model_config: Any) -> tuple[RefitPlan, list[str]]:
    """``RefitPlan`` and vLLM ``ignored_layers`` for ``model_config`` (meta model, no memory).

    Fused MoE experts (transformers 5 ``...mlp.experts`` holding ``gate_up_proj``/``down_proj``
    parameters, not Linears) follow the layer rules of ``plan_layer_precision``: FP8 unless the
    layer is in the first/last BF16 layers or ``fp8_ignore_patterns`` matches the container.
    """
    from nemo_fp8.fp8.policy import _matches
    from nemo_fp8.fp8 import plan_layer_precision

    model = meta_model(model_config)
    plan = plan_layer_precision(model, vllm_cfg.num_first_layers_in_bf16, vllm_cfg.num_last_layers_in_bf16,
                                vllm_cfg.fp8_ignore_patterns)
    ignored = list(plan.vllm_ignored_layers)
    lo, hi = vllm_cfg.num_first_layers_in_bf16, plan.num_layers - vllm_cfg.num_last_layers_in_bf16
    containers, num_experts = set(), {}
    for pname, param in model.named_parameters():
        m = _FUSED_EXPERTS_RE.match(pname)
        if m is None or param.dim() != 3:
            continue
        prefix, idx = m.group("prefix"), layer_index(pname)
        num_experts[prefix] = int(param.shape[0])
        if idx is not None and lo <= idx < hi and not _matches(prefix, vllm_cfg.fp8_ignore_patterns):
            containers.add(prefix)
        elif prefix not in ignored:
            ignored.insert(-1, prefix)  # keep "lm_head" last
    refit = RefitPlan(set(plan.fp8_modules), containers, "pow2" if vllm_cfg.pow2_weight_scaling_factors else "fp32",
                      num_experts=num_experts)
    state = model.state_dict()
    refit.expected = {c for name in state for c in refit.canonical_names(name)}
    refit.tensors = {name: (tuple(t.shape), t.dtype) for name, t in state.items()}
    if getattr(model.config, "tie_word_embeddings", False):
        refit.expected.discard("lm_head.weight")
    return refit, ignored


# ----------------------------------------------------------------------------- transports


def _buckets(items: Iterator[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    bucket, size = [], 0
    for name, t in items:
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def merge_ipc_handles(per_device: Sequence[Sequence[dict[str, tuple]]]) -> list[dict[str, tuple]]:
    """One ``{GPU UUID: rebuild args}`` dict per tensor from each device's handles of the same tensors.

    Args:
        per_device: for each device, one dict per tensor, in the same tensor order on every device
            (``{str(torch.cuda.get_device_properties(d).uuid): reduce_tensor(copy)[1]}``).

    Returns:
        ``merged[j]`` = the union of ``per_device[i][j]`` over devices ``i``: the non-packed
        ``ipc_handles`` of vLLM 0.22's ``IPCWeightTransferUpdateInfo`` (its trainer merges the ranks'
        handles the same way, ``IPCWeightTransferEngine._all_gather_and_merge_handles``).

    Raises:
        ValueError: no devices, devices with different numbers of tensors, or a GPU UUID twice for
            one tensor (two devices that are one GPU: a worker would get one of two copies).
    """
    if not per_device:
        raise ValueError("merge_ipc_handles: no devices")
    counts = [len(handles) for handles in per_device]
    if len(set(counts)) != 1:
        raise ValueError(f"merge_ipc_handles: the devices hold different numbers of tensors {counts}; each must "
                         "hold a copy of every tensor of the bucket")
    merged: list[dict[str, tuple]] = []
    for j in range(counts[0]):
        m: dict[str, tuple] = {}
        for i, handles in enumerate(per_device):
            for uuid, args in handles[j].items():
                if uuid in m:
                    raise ValueError(f"merge_ipc_handles: GPU {uuid} appears twice for tensor {j} (device {i} is a GPU "
                                     "already listed); each device must be a different GPU")
                m[uuid] = args
        merged.append(m)
    return merged


UpdateFn = Callable[[dict], Optional[Callable[[], None]]]  # send_weights_ipc's update_fn: None or a wait


def send_weights_ipc(named_tensors: Iterable[tuple[str, Tensor]], update_fn: UpdateFn, plan: RefitPlan,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: Optional[torch.device] = None,
                     devices: Optional[Sequence[torch.device]] = None, packed: bool = False,
                     layout=None, packer=None) -> int:
    """Quantize and send over CUDA IPC, one ``update_fn({"update_info": ...})`` per bucket.

    ``named_tensors``: ``(HF name, tensor)``, any float dtype and device, converted by ``plan.convert``
    (an FP8 Linear's [N, K] weight -> e4m3 [N, K] + fp32 ``weight_scale_inv`` [ceil(N/128), ceil(K/128)];
    KV scales -> fp32 scalars; the rest -> ``plan.dtype``); ``bucket_bytes`` counts converted bytes.
    ``update_fn`` is ``LLM.update_weights`` (or a Ray actor's method calling it): it returns None once the engine
    has loaded the bucket, or a callable that blocks until it has (its call started, e.g. a Ray call not yet
    waited on): then the next bucket is converted while the engine loads this one, and the wait comes before the
    next update. Tensors are converted on ``device`` (default: the current CUDA device) and kept alive until their
    bucket has been loaded. Returns the number of tensors sent.

    ``devices`` (a tensor-parallel engine, its workers' n GPUs as this process numbers them, e.g.
    ``cuda:0 .. cuda:n-1``): each bucket is converted on ``devices[0]`` and copied to the others, and one
    update per bucket carries every copy's handle keyed by its GPU's UUID (module docstring); every copy
    lives until the bucket is loaded. Each call sends on its own, whatever ``torch.distributed`` group this
    process is in (each data-parallel rank refits its own engine; module docstring).

    ``packed``: each bucket's tensors travel as one uint8 buffer with one IPC handle per GPU (vLLM 0.22's packed
    IPC format, ``IPCWeightTransferUpdateInfo(packed=True, tensor_sizes=...)``, whose receiver rebuilds the
    buffer once and clones each tensor out of it) instead of one handle per tensor: the receiving worker opens
    one IPC mapping per bucket, not one per tensor (an FP8 engine gets more tensors than a BF16 one: each FP8
    weight comes with its ``weight_scale_inv``). Tensors are ordered by element size within the bucket so that each
    starts at an offset its dtype can be viewed at; scalars (KV scales, shape ``[]``, which vLLM's unpacking
    cannot reshape to) follow in an unpacked update of their own.

    ``layout`` (a ``kernel_format.KernelLayout``, the engine's refit in kernel format): the converted tensors are
    stacked into the engine's own parameters (``KernelLayout.fuse``) before they are bucketed, and the returned count
    is of those.

    ``packer`` (a ``packed_in_place.InPlacePacker``, with ``packed``; ``policy.weight_sync.pack_in_place``): the
    first call records the converted stream and plans the buckets from it, every later one writes each tensor
    straight into its place in its bucket's buffer (the same bytes, fewer allocations and copies).

    Raises:
        ValueError: both ``device`` and ``devices``; ``devices`` naming one GPU twice (``merge_ipc_handles``);
            a stream that does not fit ``layout``.
    """
    if devices is not None and device is not None:
        raise ValueError("send_weights_ipc: pass device (one-GPU engine) or devices (tensor-parallel), not both")
    if not devices:
        devices = [device or torch.device("cuda", torch.cuda.current_device())]
    if packer is not None and not packed:
        raise ValueError("send_weights_ipc: packer (in-place packing) needs packed=True")
    return _send_weights_ipc_handles(named_tensors, update_fn, plan, bucket_bytes, list(devices), packed, layout,
                                     packer)


def _send_weights_ipc_handles(named_tensors: Iterable[tuple[str, Tensor]], update_fn: UpdateFn,
                              plan: RefitPlan, bucket_bytes: int, devices: list[torch.device], packed: bool,
                              layout=None, packer=None) -> int:
    """``send_weights_ipc`` into an engine of ``len(devices)`` GPUs: every bucket on every device, one update per
    bucket with a handle per tensor or, ``packed``, one per bucket (see there). At most two buckets exist at once:
    the one the engine loads and the next, converted meanwhile where ``update_fn`` returns a wait."""
    uuids = [str(torch.cuda.get_device_properties(d).uuid) for d in devices]
    if packer is not None and packer.layout is not None:
        return packer.send(named_tensors, update_fn, plan, devices, uuids)
    send = _send_packed if packed else _send_unpacked
    converted = plan.convert_all(named_tensors, devices[0])
    if packer is not None:
        converted = packer.record(converted)
    if layout is not None:
        converted = layout.fuse(converted)
    n, in_flight = 0, None
    try:
        for bucket in _buckets(converted, bucket_bytes):  # pulling a bucket converts it: while the last one loads
            _finish(in_flight)
            in_flight = send(bucket, update_fn, devices, uuids)
            n += len(bucket)
            del bucket
    except BaseException:  # a later bucket failed to convert: the engine may still read the last one's memory
        _finish(in_flight, quiet=True)
        raise
    _finish(in_flight)
    torch.cuda.ipc_collect()  # the last bucket's tensors on devices[0], released as the bucket stream ended
    if packer is not None:
        packer.plan_recorded(layout)
    return n


@dataclass
class _InFlight:
    """A bucket's updates the engine may still be loading: the waits ``update_fn`` returned (none: it loaded
    before returning) and the tensors whose IPC handles it reads, kept alive until every wait has returned."""

    waits: list[Callable[[], None]]
    keep: list[Tensor]

    def add(self, wait, keep: list[Tensor]) -> None:
        """One more update: ``update_fn``'s return (a wait, or None when it loaded before returning) and the
        tensors its handles point at."""
        self.waits += [wait] if callable(wait) else []
        self.keep += keep


def _finish(in_flight: Optional[_InFlight], quiet: bool = False) -> None:
    """Wait for the bucket's updates, then let its tensors go and free what the workers released. ``quiet``: an
    update's error is dropped (another error is on its way up)."""
    if in_flight is None:
        return
    for wait in in_flight.waits:
        try:
            wait()
        except Exception:
            if not quiet:
                raise
    in_flight.keep.clear()
    torch.cuda.ipc_collect()  # as vLLM's trainer does after each send: free what the workers released


def _tensor_fields(items: list[tuple[str, Tensor]]) -> dict[str, list]:
    """The per-tensor fields of vLLM's ``IPCWeightTransferUpdateInfo``, packed or not: names, dtype names, shapes."""
    return {"names": [name for name, _ in items], "dtype_names": [str(t.dtype).split(".")[-1] for _, t in items],
            "shapes": [list(t.shape) for _, t in items]}


def _send_unpacked(bucket: list[tuple[str, Tensor]], update_fn: UpdateFn, devices: list[torch.device],
                   uuids: list[str]) -> _InFlight:
    """One update of ``bucket`` with one handle per tensor and GPU; returns it in flight (``_InFlight``)."""
    from torch.multiprocessing.reductions import reduce_tensor
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

    # reduce_tensor's args do not keep the memory alive: every copy is held until the engine has loaded the
    # bucket. reduce_tensor records an event on the current stream after the conversion's kernels, which the
    # receiving worker waits on before reading; a copy to another GPU is ordered before that GPU's current stream
    # (torch's cross-device copy)
    copies: list[Tensor] = []
    per_device: list[list[dict[str, tuple]]] = []
    for dev, uuid in zip(devices, uuids):
        handles = []
        for _, t in bucket:
            copy = t.detach().to(dev).contiguous()  # devices[0]: the converted tensor itself
            copies.append(copy)
            handles.append({uuid: reduce_tensor(copy)[1]})
        per_device.append(handles)
    info = IPCWeightTransferUpdateInfo(**_tensor_fields(bucket), ipc_handles=merge_ipc_handles(per_device),
                                       packed=False)
    in_flight = _InFlight([], [])
    in_flight.add(update_fn({"update_info": asdict(info)}), copies)
    return in_flight


def _send_packed(bucket: list[tuple[str, Tensor]], update_fn: UpdateFn, devices: list[torch.device],
                 uuids: list[str]) -> _InFlight:
    """``bucket`` as one uint8 buffer with one handle per GPU (``send_weights_ipc(..., packed=True)``), then its
    scalars, if any, in an unpacked update; returns both in flight (``_InFlight``)."""
    scalars = [(name, t) for name, t in bucket if t.dim() == 0]
    # widest dtype first: every offset is a multiple of the sizes of the dtypes that follow it
    items = sorted(((name, t) for name, t in bucket if t.dim() > 0), key=lambda it: -it[1].element_size())
    buffer = None
    if items:
        flats = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in items]
        total = sum(f.numel() for f in flats)
        if len(flats) == 1 and total >= PACKED_MIN_BUFFER_BYTES:
            buffer = flats[0]  # a large tensor alone: shared as it is
        else:  # vLLM's receiver reads the first sum(tensor_sizes) bytes of a buffer (packed_ipc_consumer)
            buffer = torch.empty(max(total, PACKED_MIN_BUFFER_BYTES), dtype=torch.uint8, device=flats[0].device)
            torch.cat(flats, out=buffer[:total])
        del flats
    return send_packed_buffer(buffer, _tensor_fields(items), [t.numel() * t.element_size() for _, t in items],
                              scalars, update_fn, devices, uuids)


def send_packed_buffer(buffer: Optional[Tensor], fields: dict[str, list], tensor_sizes: list[int],
                       scalars: list[tuple[str, Tensor]], update_fn: UpdateFn, devices: list[torch.device],
                       uuids: list[str]) -> _InFlight:
    """One packed update of ``buffer`` (uint8 on ``devices[0]``, its tensors back to back from offset 0; None: no
    tensors) with one handle per GPU, the buffer copied to the other ``devices``, then ``scalars`` (name, fp32
    scalar) in an unpacked update; returns both in flight (``_InFlight``, the copies held until the engine has
    loaded them).

    Args:
        fields: the tensors' ``names``, ``dtype_names`` and ``shapes`` in the buffer's order (``_tensor_fields``).
        tensor_sizes: their bytes, in that order (vLLM's ``packed_ipc_consumer`` splits the buffer at them).
    """
    from torch.multiprocessing.reductions import reduce_tensor
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

    in_flight = _InFlight([], [])
    if buffer is not None:
        copies = [buffer] + [buffer.to(dev) for dev in devices[1:]]  # held until the engine has loaded them
        info = IPCWeightTransferUpdateInfo(
            **fields, ipc_handles={uuid: reduce_tensor(c)[1] for uuid, c in zip(uuids, copies)},
            tensor_sizes=tensor_sizes, packed=True)
        in_flight.add(update_fn({"update_info": asdict(info)}), copies)
    if scalars:
        rest = _send_unpacked(scalars, update_fn, devices, uuids)
        in_flight.waits += rest.waits
        in_flight.keep += rest.keep
    return in_flight


def nccl_init_info(master_address: str, master_port: int, world_size: int, rank_offset: int = 1) -> dict[str, Any]:
    """``init_info`` of ``LLM.init_weight_transfer_engine`` for an engine whose workers join the trainer's group.

    vLLM 0.22's ``NCCLWeightTransferEngine.init_transfer_engine`` gives worker ``r`` of a (data-parallel 1)
    engine rank ``r + rank_offset``; the trainer is rank 0, engine ``i`` of ``e`` engines of ``n`` workers
    takes ``rank_offset = 1 + i*n``: one group of ``world_size = 1 + e*n`` over all engines' workers, so one
    broadcast reaches them all. ``master_address:master_port`` is where the trainer's rank 0 serves the
    group's TCP store (``nccl_trainer_init``).
    """
    return {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size)}


def nccl_trainer_init(master_address: str, master_port: int, world_size: int) -> Any:
    """Rank 0 (the trainer) of the refit's NCCL group, on this process's current CUDA device.

    vLLM 0.22's ``NCCLWeightTransferEngine.trainer_init``: a ``StatelessProcessGroup`` (its TCP store served
    here at ``master_address:master_port``, outside ``torch.distributed``'s global group, so a trainer's own
    data-parallel group is untouched) and a ``PyNcclCommunicator`` over it. Blocks until the engine's
    workers have joined (``LLM.init_weight_transfer_engine`` with ``nccl_init_info``, called at the same
    time). Returns the communicator (``send_weights_nccl``'s ``group``; ``.destroy()`` releases it).
    """
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    return NCCLWeightTransferEngine.trainer_init({"master_address": master_address, "master_port": int(master_port),
                                                  "world_size": int(world_size)})


def nccl_update_info(named_tensors: Sequence[tuple[str, Tensor]], plan: RefitPlan, packed: bool = True
                     ) -> dict[str, Any]:
    """What the engine's workers must know before a broadcast: the ``update_info`` of vLLM 0.22's
    ``NCCLWeightTransferUpdateInfo`` for the converted form of ``named_tensors``.

    ``names`` / ``dtype_names`` / ``shapes`` list, in order, the tensors ``plan.convert_all(named_tensors)``
    yields (``RefitPlan.converted_meta``; no data touched): the receiving workers allocate exactly these and,
    ``packed``, cut the stream into the same chunks as the sender (both count bytes from them), so a
    mismatch would load wrong bytes into the model.
    """
    meta = [m for name, t in named_tensors for m in plan.converted_meta(name, tuple(t.shape), t.dtype)]
    return {"names": [m[0] for m in meta], "dtype_names": [m[1] for m in meta], "shapes": [m[2] for m in meta],
            "packed": packed}


def send_weights_nccl(named_tensors: list[tuple[str, Tensor]], update_fn: Callable[[dict], None], plan: RefitPlan,
                      group: Any, src: int = 0, packed: bool = True, device: Optional[torch.device] = None) -> int:
    """Quantize one bucket on the trainer's GPU and broadcast it over NCCL (trainer not on the engine's GPUs).

    ``named_tensors``: ``(HF name, tensor)``, converted by ``plan.convert`` on ``device`` (default: the
    current CUDA device; an FP8 Linear's [N, K] weight -> e4m3 [N, K] + fp32 ``weight_scale_inv``
    [ceil(N/128), ceil(K/128)], KV scales -> fp32 scalars, the rest -> ``plan.dtype``). The engine side is
    told names/dtypes/shapes first (``nccl_update_info``): ``update_fn({"update_info": info})`` (a call
    that ends in ``LLM.update_weights``) runs in a thread, because it returns only once the engine's workers
    have received and loaded the broadcast, which this thread sends meanwhile with vLLM 0.22's
    ``NCCLWeightTransferEngine.trainer_send_weights`` (packed: the bucket as one uint8 buffer per 1 GiB).
    ``group`` is the communicator of ``nccl_trainer_init``. Returns the number of tensors sent.

    Raises:
        whatever ``update_fn`` raised (re-raised here after the broadcast). An engine that fails after it
        took the names but before it received leaves the broadcast waiting: NCCL has no timeout here, so the
        names are checked before this call (``RefitPlan.checked_names``) rather than in the engine.
    """
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    info = nccl_update_info(named_tensors, plan, packed)
    errors: list[BaseException] = []

    def receive():
        try:
            update_fn({"update_info": info})
        except BaseException as e:  # re-raised below
            errors.append(e)

    th = threading.Thread(target=receive, daemon=True)
    th.start()
    device = device or torch.device("cuda", torch.cuda.current_device())
    NCCLWeightTransferEngine.trainer_send_weights(plan.convert_all(named_tensors, device),
                                                  {"group": group, "src": src, "packed": packed})
    th.join()
    if errors:
        raise errors[0]
    return len(info["names"])
