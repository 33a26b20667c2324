"""Where the host's time goes in a training pass: cProfile over a callable, grouped by library part.

A pass is host-bound when the CPU issues kernels more slowly than the GPU runs them (``tools/bench_train.py
--profile``'s ``host`` column: wall - GPU kernel time). That column says how much; this module says where: each
Python function's own time (cProfile's ``tottime``: time in the function's body and in the C functions it calls
that cProfile does not list separately) summed over the functions of one library part:

* ``te.module``: TransformerEngine's modules (``transformer_engine/pytorch/module``: ``Linear``,
  ``LayerNormLinear``, ``LayerNormMLP`` forward/backward, their workspace and weight-cache checks);
* ``te.quant``: TE's quantizers and FP8 tensor classes (``tensor/``, ``quantized_tensor``, ``float8_*``);
* ``te.recipe``: TE's recipe state and autocast (``fp8.py`` / ``quantization.py``, ``recipe/``);
* ``te.ops``: TE's C++ extension calls (``transformer_engine_torch.*``: the GEMMs, casts and fused kernels as
  the host sees them: argument checks, quantizer conversion, kernel launches);
* ``te.attention``, ``te.other``: the rest of TE;
* ``megatron``: megatron-core (``megatron/core``: layers, the FP8 context per layer, RoPE, the schedules);
* ``torch.autograd``, ``torch.nn``, ``torch.ops`` (aten calls made from Python), ``torch.other``;
* ``ours``: ``nemo_fp8`` (the log-prob kernels, the loss);
* ``cuda.launch``: ``cudaLaunchKernel`` as Python sees it (triton's launcher);
* ``gpu.wait``: the host waiting for the GPU (``torch.cuda.synchronize``: the ``sync`` after the last pass, and
  any sync inside a pass), not host work;
* ``other``.

cProfile adds its own cost to every Python call (about 1 us each), so the absolute numbers overstate Python-heavy
parts; ``wall_profiled_ms`` against the unprofiled wall says by how much. The ranking is what it is for.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from typing import Callable

PARTS = (  # first match wins
    ("ours", ("nemo_fp8/",)),
    ("te.module", ("transformer_engine/pytorch/module/",)),
    ("te.quant", ("transformer_engine/pytorch/tensor/", "quantized_tensor", "float8_")),
    ("te.recipe", ("transformer_engine/pytorch/fp8.py", "transformer_engine/pytorch/quantization.py",
                   "transformer_engine/common/recipe", "transformer_engine/pytorch/distributed.py")),
    ("te.attention", ("transformer_engine/pytorch/attention/", "transformer_engine/pytorch/dot_product_attention")),
    ("te.other", ("transformer_engine/",)),
    ("megatron", ("megatron/",)),
    ("torch.autograd", ("torch/autograd/", "torch/_tensor.py")),
    ("torch.nn", ("torch/nn/",)),
    ("triton", ("triton/",)),
    ("torch.other", ("torch/",)),
)


def part_of(filename: str, funcname: str) -> str:
    """The library part (``PARTS`` name, or ``te.ops`` / ``torch.ops`` / ``cuda.launch`` / ``gpu.wait`` /
    ``other``) of one cProfile entry: ``filename`` its file (``~`` for a C function), ``funcname`` its name
    (for a C function cProfile's ``<built-in method NAME>`` / ``<method 'NAME' of 'CLASS' objects>``)."""
    if filename == "~":
        if "synchronize" in funcname:
            return "gpu.wait"
        if "transformer_engine_torch" in funcname or "tex." in funcname:
            return "te.ops"
        if "torch._C" in funcname or "torch._ops" in funcname or "of 'torch._C" in funcname:
            return "torch.ops"
        if "cuLaunch" in funcname or "launch" in funcname.lower():
            return "cuda.launch"
        if "method" in funcname and ("Tensor" in funcname or "torch" in funcname):
            return "torch.ops"
        return "other"
    path = filename.replace("\\", "/")
    for name, keys in PARTS:
        if any(k in path for k in keys):
            return name
    return "other"


def host_profile(fn: Callable[[], None], rounds: int, sync: Callable[[], None] = lambda: None,
                 top: int = 25) -> dict:
    """``fn`` run ``rounds`` times under cProfile.

    Args:
        fn: one pass (e.g. a forward + backward); ``sync`` is called after the last (``torch.cuda.synchronize``)
            so that the wall time covers the GPU's work too.
        rounds: passes (>= 1).
        top: functions kept in ``top_functions``.

    Returns:
        ``wall_profiled_ms`` (per pass, under the profiler), ``calls`` (Python + C function calls per pass),
        ``parts`` ({part: own ms per pass}, ``part_of``'s names, largest first), and ``top_functions``: the
        ``top`` functions by own time, each ``{"function": "file:line(name)", "part", "own_ms", "cum_ms",
        "calls"}`` per pass.

    Raises:
        ValueError: ``rounds < 1``.
    """
    if rounds < 1:
        raise ValueError(f"host_profile: rounds must be >= 1, got {rounds}")
    prof = cProfile.Profile()
    sync()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(rounds):
        fn()
    sync()
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    parts: dict[str, float] = {}
    rows = []
    calls = 0
    for (filename, line, name), (_, ncalls, own, cum, _) in stats.items():
        part = part_of(filename, name)
        parts[part] = parts.get(part, 0.0) + own
        calls += ncalls
        rows.append(dict(function=f"{_short(filename)}:{line}({name})", part=part, own_ms=own * 1e3 / rounds,
                         cum_ms=cum * 1e3 / rounds, calls=ncalls / rounds))
    rows.sort(key=lambda r: -r["own_ms"])
    return dict(wall_profiled_ms=wall * 1e3 / rounds, calls=calls / rounds,
                parts={k: v * 1e3 / rounds for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
                top_functions=rows[:top])


def _short(filename: str) -> str:
    """A file path from its package root (``.../site-packages/te/x.py`` -> ``te/x.py``)."""
    path = filename.replace("\\", "/")
    for root in ("site-packages/", "dist-packages/"):
        if root in path:
            return path.split(root, 1)[1]
    for package in ("nemo_fp8/", "tools/"):
        i = path.rfind("/" + package)
        if i >= 0:
            return path[i + 1:]
    return path


def format_host_profile(label: str, prof: dict, wall_ms: float | None = None) -> str:
    """A text block of ``host_profile``'s result: the parts, then the top functions (ms per pass)."""
    lines = [f"host profile {label}: {prof['wall_profiled_ms']:.1f} ms per pass under cProfile"
             + (f" ({wall_ms:.1f} ms without)" if wall_ms else "") + f", {prof['calls']:.0f} calls per pass"]
    lines.append("  own ms by part: " + ", ".join(f"{k} {v:.1f}" for k, v in prof["parts"].items() if v >= 0.05))
    lines.append(f"  {'own ms':>8} {'cum ms':>8} {'calls':>7}  function")
    for r in prof["top_functions"]:
        lines.append(f"  {r['own_ms']:8.2f} {r['cum_ms']:8.2f} {r['calls']:7.0f}  {r['function']} [{r['part']}]")
    return "\n".join(lines)
