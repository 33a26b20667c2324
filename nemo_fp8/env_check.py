"""What this machine can run: GPU, driver, CUDA libraries, engines, and which FP8 settings work.

``probe_environment()`` collects the facts without importing an engine (vLLM, TransformerEngine and
Megatron are looked up by their package metadata, the GPU through NVML, cuBLAS through its own
``cublasLtGetVersion``) and without creating a CUDA context, so it is safe in the driver process
before Ray or vLLM start. Every probe is guarded: a missing package, library or GPU gives ``None``
with the reason in ``EnvReport.reasons``, never an exception.

``precision_support(report)`` says, for each precision setting, whether it can run here and why
(the rules are the engines' own: vLLM 0.22's FP8 kernel choice and attention backends,
TransformerEngine 2.11's ``check_fp8_support`` / ``check_fp8_block_scaling_support``).
``config_support_errors(cfg)`` turns that into one ``key: reason (valid here: ...)`` line per request
in a config that cannot run here; ``check_config_supported(cfg)`` raises them as a ``ConfigError``
before any model is loaded. ``nemo-fp8-check-env`` (``tools/check_env.py``) prints the report and the table;
the TransformerEngine recipe rule is ``nemo_fp8.policy.megatron.support`` (the backend asks TE the same question).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import json
import os
import platform
import re
import shutil
import sys
from dataclasses import asdict, dataclass, field
from importlib import metadata, util
from pathlib import Path
from typing import Any, Callable, Optional

from nemo_fp8.policy.megatron.support import Support, te_fp8_support

__all__ = ["EnvReport", "Support", "probe_environment", "precision_support", "config_support_errors",
           "check_config_supported", "format_report", "format_support_table", "main"]

MEGATRON_MIN_PYTHON = (3, 12)
INSTALL_HINT = "the container in docker/ has the whole stack"


@dataclass
class EnvReport:
    """Facts about this machine; a field is None where the thing is absent (``reasons`` says why)."""

    python: str = field(default_factory=platform.python_version)
    os: str = field(default_factory=lambda: f"{platform.system()} {platform.machine()}")
    gpu_name: Optional[str] = None
    gpu_count: int = 0
    compute_capability: Optional[tuple[int, int]] = None
    driver: Optional[str] = None           # NVIDIA driver, e.g. "580.159.04"
    cuda_driver: Optional[str] = None      # the newest CUDA the driver supports, e.g. "13.0"
    cuda_runtime: Optional[str] = None     # the CUDA torch was built with (torch.version.cuda)
    cublas: Optional[str] = None           # e.g. "13.0.0"
    cudnn: Optional[str] = None            # torch's cuDNN
    nccl: Optional[str] = None
    torch: Optional[str] = None
    vllm: Optional[str] = None
    sglang: Optional[str] = None           # the second rollout engine (its own site folder on the GPU host)
    transformer_engine: Optional[str] = None
    transformer_engine_torch: Optional[str] = None
    megatron_core: Optional[str] = None
    megatron_bridge: Optional[str] = None
    deep_gemm: Optional[str] = None        # where DeepGEMM comes from, e.g. "bundled with vLLM 0.22.0"
    pinned: dict[str, str] = field(default_factory=dict)    # the GPU stack's pins (pyproject extras)
    reasons: dict[str, str] = field(default_factory=dict)   # field -> why it is None
    notes: list[str] = field(default_factory=list)          # warnings that do not block anything

    @property
    def has_gpu(self) -> bool:
        return self.compute_capability is not None

    @property
    def sm(self) -> str:
        cc = self.compute_capability
        return f"sm_{cc[0]}{cc[1]}" if cc else "no GPU"

    def why(self, name: str) -> str:
        return self.reasons.get(name, "not found")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compute_capability"] = list(self.compute_capability) if self.compute_capability else None
        return d


# --------------------------------------------------------------------------- probes
def _version_tuple(v: Optional[str]) -> Optional[tuple[int, ...]]:
    if not v:
        return None
    nums = re.findall(r"\d+", v.split("+")[0])
    return tuple(int(n) for n in nums[:3]) if nums else None


def _dist_version(*names: str) -> Optional[str]:
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
        except Exception:  # a broken install: treat as absent
            continue
    return None


def _probe_nvml(r: EnvReport) -> bool:
    """GPU name, count, compute capability and driver through NVML (no CUDA context)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        r.reasons["gpu_name"] = "no NVIDIA driver (libnvidia-ml.so.1 not found)"
        return False
    try:
        if nvml.nvmlInit_v2() != 0:
            r.reasons["gpu_name"] = "NVML failed to initialize (driver not loaded?)"
            return False
        try:
            buf = ctypes.create_string_buffer(96)
            if nvml.nvmlSystemGetDriverVersion(buf, 96) == 0:
                r.driver = buf.value.decode()
            count = ctypes.c_uint(0)
            nvml.nvmlDeviceGetCount_v2(ctypes.byref(count))
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            indices = list(range(count.value))
            if visible is not None:
                wanted = [v.strip() for v in visible.split(",") if v.strip()]
                indices = [int(v) for v in wanted if v.isdigit() and int(v) < count.value] if all(
                    v.isdigit() for v in wanted) else indices[:len(wanted)]
            r.gpu_count = len(indices)
            if not indices:
                r.reasons["gpu_name"] = ("no GPU visible" + (f" (CUDA_VISIBLE_DEVICES={visible!r})"
                                                            if visible is not None else ""))
                return False
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByIndex_v2(indices[0], ctypes.byref(handle)) != 0:
                r.reasons["gpu_name"] = "NVML could not open GPU 0"
                return False
            if nvml.nvmlDeviceGetName(handle, buf, 96) == 0:
                r.gpu_name = buf.value.decode()
            major, minor = ctypes.c_int(0), ctypes.c_int(0)
            if nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) == 0:
                r.compute_capability = (major.value, minor.value)
            return r.compute_capability is not None
        finally:
            nvml.nvmlShutdown()
    except Exception as e:  # an old driver without one of the symbols
        r.reasons["gpu_name"] = f"NVML query failed: {type(e).__name__}: {e}"
        return False


def _probe_cuda_driver(r: EnvReport) -> None:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        if cuda.cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value:
            r.cuda_driver = f"{v.value // 1000}.{(v.value % 1000) // 10}"
            return
        r.reasons["cuda_driver"] = "cuDriverGetVersion failed"
    except OSError:
        r.reasons["cuda_driver"] = "no CUDA driver (libcuda.so.1 not found)"
    except Exception as e:
        r.reasons["cuda_driver"] = f"cuDriverGetVersion failed: {type(e).__name__}: {e}"


def _probe_torch(r: EnvReport) -> None:
    r.torch = _dist_version("torch")
    if r.torch is None:
        for k in ("torch", "cuda_runtime", "cudnn", "nccl"):
            r.reasons[k] = "torch not installed"
        return
    try:
        import torch
    except Exception as e:
        for k in ("cuda_runtime", "cudnn", "nccl"):
            r.reasons[k] = f"torch does not import: {type(e).__name__}: {e}"
        return
    r.cuda_runtime = getattr(torch.version, "cuda", None)
    if r.cuda_runtime is None:
        for k in ("cuda_runtime", "cudnn", "nccl"):
            r.reasons[k] = f"torch {r.torch} is a CPU-only build"
        return
    try:
        v = torch.backends.cudnn.version()
        if v:
            r.cudnn = f"{v // 10000}.{(v % 10000) // 100}.{v % 100}" if v >= 10000 else str(v)
        else:
            r.reasons["cudnn"] = "torch reports no cuDNN"
    except Exception as e:
        r.reasons["cudnn"] = f"cuDNN did not load: {type(e).__name__}: {e}"
    try:
        v = torch.cuda.nccl.version()
        r.nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:
        r.reasons["nccl"] = f"NCCL not available in torch: {type(e).__name__}: {e}"
    if not r.has_gpu and "gpu_name" in r.reasons and "NVML" not in r.reasons["gpu_name"]:
        return  # no driver at all: do not ask torch (it would only say the same, slowly)
    if not r.has_gpu:  # NVML failed but a driver may be there: ask torch (this creates a context)
        try:
            if torch.cuda.is_available():
                r.gpu_count = torch.cuda.device_count()
                r.gpu_name = torch.cuda.get_device_name(0)
                r.compute_capability = tuple(torch.cuda.get_device_capability(0))
                r.reasons.pop("gpu_name", None)
        except Exception as e:
            r.reasons["gpu_name"] += f"; torch.cuda: {type(e).__name__}: {e}"


def _nvidia_lib_dirs() -> list[Path]:
    """``nvidia/*/lib`` folders of the pip CUDA packages (where torch's CUDA libraries come from)."""
    spec = util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    return [Path(p) for root in roots for p in sorted(glob.glob(os.path.join(root, "*", "lib")))]


def _cublaslt_version(path: str) -> Optional[str]:
    lib = ctypes.CDLL(path)
    lib.cublasLtGetVersion.restype = ctypes.c_size_t
    v = int(lib.cublasLtGetVersion())
    return f"{v // 10000}.{(v % 10000) // 100}.{v % 100}" if v else None


def _probe_cublas(r: EnvReport) -> None:
    """The cuBLASLt that this process uses (already mapped), else torch's pip copy, else the system one."""
    candidates: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            candidates += sorted({line.split()[-1] for line in f if "libcublasLt.so" in line})
    except OSError:
        pass
    for d in _nvidia_lib_dirs():
        candidates += sorted(glob.glob(str(d / "libcublasLt.so.*")))
    found = ctypes.util.find_library("cublasLt")
    if found:
        candidates.append(found)
    if r.cuda_runtime:  # torch's CUDA major first (cu12 and cu13 packages can sit side by side)
        major = r.cuda_runtime.split(".")[0]
        candidates.sort(key=lambda c: not re.search(rf"libcublasLt\.so\.{major}(\.|$)", c))
    errors = []
    for c in dict.fromkeys(candidates):
        try:
            v = _cublaslt_version(c)
            if v:
                r.cublas = v
                return
        except Exception as e:
            errors.append(f"{c}: {e}")
    dist = _dist_version("nvidia-cublas", "nvidia-cublas-cu13", "nvidia-cublas-cu12")
    if dist:
        r.cublas = ".".join(dist.split(".")[:3])
        return
    r.reasons["cublas"] = "libcublasLt not found" + (f" ({'; '.join(errors)})" if errors else
                                                      " (no CUDA build of torch, no system CUDA)")


def _probe_engines(r: EnvReport) -> None:
    r.vllm = _dist_version("vllm")
    if r.vllm is None:
        r.reasons["vllm"] = f"not installed ({INSTALL_HINT})"
    r.sglang = _dist_version("sglang")
    if r.sglang is None:
        r.reasons["sglang"] = "not installed (pyproject extra 'sglang', staged apart: docs/rollout-engines.md)"
    r.transformer_engine = _dist_version("transformer-engine", "transformer-engine-cu13", "transformer-engine-cu12")
    r.transformer_engine_torch = _dist_version("transformer-engine-torch")
    if r.transformer_engine is None:
        r.reasons["transformer_engine"] = f"not installed ({INSTALL_HINT})"
    if r.transformer_engine_torch is None:
        r.reasons["transformer_engine_torch"] = "TransformerEngine's PyTorch extension is not installed"
    old_python = sys.version_info[:2] < MEGATRON_MIN_PYTHON
    py_reason = f"not installed (it needs Python >= 3.12; this is {r.python})"
    r.megatron_core = _dist_version("megatron-core")
    if r.megatron_core is None:
        r.reasons["megatron_core"] = py_reason if old_python else f"not installed ({INSTALL_HINT})"
    r.megatron_bridge = _dist_version("megatron-bridge")
    if r.megatron_bridge is None:
        r.reasons["megatron_bridge"] = py_reason if old_python else f"not installed ({INSTALL_HINT})"
    # DeepGEMM: vLLM 0.22 bundles it (vllm/third_party/deep_gemm); a standalone package also counts.
    try:
        if r.vllm and metadata.distribution("vllm").locate_file("vllm/third_party/deep_gemm/__init__.py").exists():
            r.deep_gemm = f"bundled with vLLM {r.vllm}"
    except Exception:
        pass
    if r.deep_gemm is None:
        try:
            if util.find_spec("deep_gemm") is not None:
                r.deep_gemm = f"deep_gemm {_dist_version('deep-gemm', 'deep_gemm') or '(version unknown)'}"
        except Exception:
            pass
    if r.deep_gemm is None:
        r.reasons["deep_gemm"] = ("not found (vLLM is not installed)" if r.vllm is None
                                  else "not found (neither vllm/third_party/deep_gemm nor a deep_gemm package)")


def _probe_pins(r: EnvReport) -> None:
    """The GPU stack's pins (installed metadata, else this checkout's pyproject.toml) vs what is installed."""
    try:
        from nemo_fp8.utils.pins import installed_stack_pins, stack_pins
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"  # this checkout's, when run from one
        if pyproject.is_file() and sys.version_info >= (3, 11):
            pins = stack_pins(pyproject)
        else:
            pins = installed_stack_pins()
    except Exception as e:
        r.notes.append(f"could not read the pinned versions: {type(e).__name__}: {e}")
        return
    r.pinned = {p.name: p.version for p in pins if p.version}
    if not (r.has_gpu or r.vllm or r.transformer_engine or r.megatron_core):
        return  # a CPU machine without the stack: its torch/transformers are not meant to match
    for name, want in r.pinned.items():
        have = _dist_version(name)
        if have is not None and have.split("+")[0] != want:
            r.notes.append(f"{name} {have} is installed; the stack pins {want} (pyproject.toml)")


def _probe_cudnn_mix(r: EnvReport) -> None:
    """The GPU host's failure: a system cuDNN beside torch's makes TE's fused attention fail."""
    if r.cudnn is None:
        return
    system = sorted(set(glob.glob("/usr/lib/x86_64-linux-gnu/libcudnn.so.*.*")
                        + glob.glob("/usr/local/cuda/lib64/libcudnn.so.*.*")))
    preload = os.environ.get("LD_PRELOAD", "")
    if system and "libcudnn" not in preload:
        ver = re.sub(r".*libcudnn\.so\.", "", system[-1])
        if not r.cudnn.startswith(ver.rsplit(".", 1)[0]):
            r.notes.append(f"a system cuDNN {ver} is installed beside torch's {r.cudnn}: TransformerEngine may load "
                           "the system one (fused attention fails with CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED); "
                           "preload torch's (LD_PRELOAD=.../nvidia/cudnn/lib/libcudnn.so.9), as docker/Dockerfile "
                           "and the GPU host's env.sh do")


def _probe_nvcc(r: EnvReport) -> None:
    if r.deep_gemm is None or not r.has_gpu:
        return
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    if not (Path(home) / "bin" / "nvcc").exists() and shutil.which("nvcc") is None:
        r.notes.append("no nvcc found (CUDA_HOME, PATH): DeepGEMM compiles its kernels on first use and may fail")


def probe_environment() -> EnvReport:
    """Collect the facts; never raises."""
    r = EnvReport()
    for probe in (_probe_nvml, _probe_cuda_driver, _probe_torch, _probe_cublas, _probe_engines, _probe_pins,
                  _probe_cudnn_mix, _probe_nvcc):
        try:
            probe(r)
        except Exception as e:  # a probe's own bug must not stop a run: record it
            r.notes.append(f"probe {probe.__name__} failed: {type(e).__name__}: {e}")
    if not r.has_gpu:
        r.reasons.setdefault("gpu_name", "no CUDA GPU found")
        r.reasons.setdefault("compute_capability", r.reasons["gpu_name"])
        if r.driver is None:
            r.reasons.setdefault("driver", r.reasons["gpu_name"])
    return r


# --------------------------------------------------------------------------- what can run
def _no_gpu(r: EnvReport) -> Optional[str]:
    return None if r.has_gpu else f"no CUDA GPU here ({r.why('gpu_name')})"


def _cublas_or_cuda(r: EnvReport) -> tuple[Optional[tuple[int, ...]], str]:
    if r.cublas:
        return _version_tuple(r.cublas), f"cuBLAS {r.cublas}"
    if r.cuda_runtime:  # cuBLAS ships with the CUDA release torch was built with
        return _version_tuple(r.cuda_runtime), f"cuBLAS of CUDA {r.cuda_runtime} (version not found: {r.why('cublas')})"
    return None, f"cuBLAS not found ({r.why('cublas')})"


def precision_support(report: EnvReport) -> dict[str, Support]:
    """Which engines and precision settings can run on ``report``'s machine, each with its reason.

    Keys: ``vllm_backend``, ``fp8_rollout``, ``fp8_kv_cache``, ``deep_gemm``, ``sglang_backend``, ``megatron_backend``,
    ``te_fp8_tensorwise``, ``te_fp8_blockwise``. The torch reference backends emulate FP8 and run
    anywhere; these rows are about the real engines.
    """
    r, out = report, {}
    cc, sm, no_gpu = r.compute_capability, r.sm, _no_gpu(report)

    # vLLM
    if r.vllm is None:
        out["vllm_backend"] = Support(False, f"vLLM {r.why('vllm')}")
    elif no_gpu:
        out["vllm_backend"] = Support(False, no_gpu)
    elif cc < (7, 0):
        out["vllm_backend"] = Support(False, f"vLLM needs compute capability 7.0+ ({sm})")
    else:
        out["vllm_backend"] = Support(True, f"vLLM {r.vllm} on {r.gpu_name} ({sm})")
    if not out["vllm_backend"].ok:
        out["fp8_rollout"] = Support(False, out["vllm_backend"].reason)
    elif cc < (8, 9):
        out["fp8_rollout"] = Support(False, f"{sm} has no FP8 tensor cores (W8A8 needs sm_89+): vLLM would fall back "
                                            "to weight-only FP8 (Marlin, W8A16), not the W8A8 rollout asked for")
    elif cc[0] in (9, 10):
        out["fp8_rollout"] = Support(True, f"W8A8 block FP8 on {sm}: CUTLASS block-scaled GEMM (DeepGEMM if enabled)")
    else:
        out["fp8_rollout"] = Support(True, f"W8A8 block FP8 on {sm}: Triton block-scaled GEMM "
                                           "(CUTLASS block kernels and DeepGEMM need sm_90/sm_100)")
    if not out["fp8_rollout"].ok:
        out["fp8_kv_cache"] = Support(False, f"needs FP8 rollout, which cannot run: {out['fp8_rollout'].reason}")
    elif cc[0] == 9:
        out["fp8_kv_cache"] = Support(True, f"FlashAttention 3 with FP8 KV cache ({sm})")
    else:
        out["fp8_kv_cache"] = Support(True, f"TRITON_ATTN backend ({sm}; FlashAttention's FP8 KV cache is sm_90 only)")
    if not out["fp8_rollout"].ok:
        out["deep_gemm"] = Support(False, f"needs FP8 rollout, which cannot run: {out['fp8_rollout'].reason}")
    elif r.deep_gemm is None:
        out["deep_gemm"] = Support(False, f"DeepGEMM {r.why('deep_gemm')}")
    elif cc == (9, 0) or cc[0] == 10:
        out["deep_gemm"] = Support(True, f"DeepGEMM ({r.deep_gemm}) on {sm}; JIT-compiles its kernels on first use")
    else:
        out["deep_gemm"] = Support(False, f"DeepGEMM runs on sm_90 and sm_100-family GPUs only (this is {sm})")

    # SGLang: FA3 (sm_80-sm_90) is the attention backend whose kernels read the FP8 KV scales a refit writes
    if no_gpu or r.sglang is None:
        out["sglang_backend"] = Support(False, no_gpu or f"SGLang {r.why('sglang')}")
    elif not (8, 0) <= cc <= (9, 0):
        out["sglang_backend"] = Support(False, f"SGLang's FA3 attention needs sm_80-sm_90 ({sm})")
    else:
        out["sglang_backend"] = Support(True, f"SGLang {r.sglang} on {r.gpu_name} ({sm})")

    # Megatron-core + TransformerEngine
    te_missing = (f"TransformerEngine {r.why('transformer_engine')}" if r.transformer_engine is None else
                  f"{r.why('transformer_engine_torch')}" if r.transformer_engine_torch is None else None)
    if r.megatron_core is None:
        out["megatron_backend"] = Support(False, f"megatron-core {r.why('megatron_core')}")
    elif te_missing:
        out["megatron_backend"] = Support(False, te_missing)
    elif no_gpu:
        out["megatron_backend"] = Support(False, no_gpu)
    else:
        out["megatron_backend"] = Support(True, f"megatron-core {r.megatron_core} + TransformerEngine "
                                                f"{r.transformer_engine} on {sm}")
    # TransformerEngine's recipes: the rule lives beside the megatron backend (one source)
    cublas, cublas_s = _cublas_or_cuda(r)
    out.update(te_fp8_support(cc, _version_tuple(r.cuda_runtime), cublas, cublas_s, unavailable=te_missing or no_gpu))
    return out


def config_support_errors(cfg, report: Optional[EnvReport] = None) -> list[str]:
    """One ``key: reason (valid here: ...)`` line per setting of ``cfg`` (a MasterConfig) that cannot
    run on this machine; [] when everything can. The torch backends emulate FP8 and run anywhere:
    only the vllm and sglang backends, the megatron backend and ``policy.device=cuda`` are checked."""
    r = report if report is not None else probe_environment()
    sup = precision_support(r)
    pol = cfg.policy
    gen, vcfg, mcfg = pol.generation, pol.generation.vllm_cfg, pol.megatron_cfg
    errs: list[str] = []
    if pol.device == "cuda" and not r.has_gpu:
        errs.append(f"policy.device: 'cuda' needs a CUDA GPU; {_no_gpu(r)} (valid here: 'cpu', 'auto')")
    if gen.backend == "vllm":
        if not sup["vllm_backend"].ok:
            errs.append(f"policy.generation.backend: 'vllm' cannot run here: {sup['vllm_backend'].reason} "
                        "(valid here: 'torch')")
        else:
            if vcfg.precision == "fp8" and not sup["fp8_rollout"].ok:
                errs.append(f"policy.generation.vllm_cfg.precision: 'fp8' cannot run here: {sup['fp8_rollout'].reason} "
                            "(valid here: 'bfloat16')")
            elif vcfg.kv_cache_is_fp8 and not sup["fp8_kv_cache"].ok:
                errs.append(f"policy.generation.vllm_cfg.kv_cache_dtype: 'fp8' cannot run here: "
                            f"{sup['fp8_kv_cache'].reason} (valid here: 'auto')")
            if vcfg.precision == "fp8" and vcfg.use_deep_gemm and sup["fp8_rollout"].ok and not sup["deep_gemm"].ok:
                errs.append(f"policy.generation.vllm_cfg.use_deep_gemm: true cannot run here: {sup['deep_gemm'].reason} "
                            "(valid here: false)")
    if gen.backend == "sglang":
        if not sup["sglang_backend"].ok:
            errs.append(f"policy.generation.backend: 'sglang' cannot run here: {sup['sglang_backend'].reason} "
                        "(valid here: 'torch')")
        elif vcfg.precision == "fp8" and r.compute_capability < (8, 9):
            errs.append(f"policy.generation.vllm_cfg.precision: 'fp8' cannot run here: {r.sm} has no FP8 tensor cores "
                        "(valid here: 'bfloat16')")
        elif vcfg.kv_cache_is_fp8 and r.compute_capability != (9, 0):
            errs.append(f"policy.generation.vllm_cfg.kv_cache_dtype: 'fp8' cannot run here: SGLang's FA3 takes an FP8 "
                        f"KV cache on sm_90 only ({r.sm}) (valid here: 'auto')")
    if mcfg.enabled:
        if not sup["megatron_backend"].ok:
            errs.append(f"policy.megatron_cfg.enabled: true cannot run here: {sup['megatron_backend'].reason} "
                        "(valid here: false, the torch backend)")
        elif mcfg.fp8_cfg.enabled:
            recipe = mcfg.fp8_cfg.fp8_recipe
            other = "tensorwise" if recipe == "blockwise" else "blockwise"
            if not sup[f"te_fp8_{recipe}"].ok:
                if sup[f"te_fp8_{other}"].ok:
                    errs.append(f"policy.megatron_cfg.fp8_cfg.fp8_recipe: '{recipe}' cannot run here: "
                                f"{sup[f'te_fp8_{recipe}'].reason} (valid here: '{other}')")
                else:
                    errs.append(f"policy.megatron_cfg.fp8_cfg.enabled: true cannot run here: "
                                f"{sup[f'te_fp8_{recipe}'].reason} (valid here: false)")
    return errs


def check_config_supported(cfg, report: Optional[EnvReport] = None) -> EnvReport:
    """Raise ``nemo_fp8.config.ConfigError`` listing every setting that cannot run here; returns the report."""
    from nemo_fp8.config import ConfigError

    r = report if report is not None else probe_environment()
    errs = config_support_errors(cfg, r)
    if errs:
        raise ConfigError("this machine cannot run the configuration "
                          f"({r.gpu_name or 'no GPU'}, {r.sm}; python tools/check_env.py shows why):\n"
                          + "\n".join(f"  - {e}" for e in errs))
    return r


# --------------------------------------------------------------------------- printing
_ROWS = [("GPU", lambda r: f"{r.gpu_name} x{r.gpu_count}" if r.gpu_name else None, "gpu_name"),
         ("compute capability", lambda r: f"{r.compute_capability[0]}.{r.compute_capability[1]} ({r.sm})"
          if r.compute_capability else None, "compute_capability"),
         ("driver", lambda r: r.driver and (f"{r.driver} (CUDA {r.cuda_driver})" if r.cuda_driver else r.driver),
          "driver"),
         ("CUDA runtime (torch)", lambda r: r.cuda_runtime, "cuda_runtime"),
         ("cuBLAS", lambda r: r.cublas, "cublas"),
         ("cuDNN (torch)", lambda r: r.cudnn, "cudnn"),
         ("NCCL", lambda r: r.nccl, "nccl"),
         ("python", lambda r: r.python, "python"),
         ("torch", lambda r: r.torch, "torch"),
         ("vllm", lambda r: r.vllm, "vllm"),
         ("sglang", lambda r: r.sglang, "sglang"),
         ("transformer_engine", lambda r: r.transformer_engine and (
             r.transformer_engine + ("" if r.transformer_engine_torch else " (no PyTorch extension)")),
          "transformer_engine"),
         ("megatron.core", lambda r: r.megatron_core, "megatron_core"),
         ("megatron.bridge", lambda r: r.megatron_bridge, "megatron_bridge"),
         ("DeepGEMM", lambda r: r.deep_gemm, "deep_gemm")]

_LABELS = {"vllm_backend": "vLLM rollout (bf16)", "fp8_rollout": "FP8 rollout (W8A8 block)",
           "fp8_kv_cache": "FP8 KV cache", "deep_gemm": "DeepGEMM", "sglang_backend": "SGLang rollout",
           "megatron_backend": "Megatron + TE training",
           "te_fp8_tensorwise": "TE FP8 tensorwise", "te_fp8_blockwise": "TE FP8 blockwise"}


def format_report(r: EnvReport) -> str:
    lines = ["environment"]
    for label, get, key in _ROWS:
        try:
            val = get(r)
        except Exception:
            val = None
        lines.append(f"  {label:<22} {val if val is not None else 'not available: ' + r.why(key)}")
    if not r.has_gpu:
        lines.append(f"  NO GPU: {r.why('gpu_name')}. The torch reference backends run here (FP8 emulated); "
                     "the vLLM and Megatron engines need a GPU.")
    for n in r.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def format_support_table(support: dict[str, Support]) -> str:
    w = max(len(_LABELS.get(k, k)) for k in support)
    lines = ["precision settings on this machine", f"  {'setting':<{w}}  can run  why"]
    for k, s in support.items():
        lines.append(f"  {_LABELS.get(k, k):<{w}}  {'yes' if s.ok else 'no':<7}  {s.reason}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None, out: Callable[[str], Any] = print) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="check_env", description="Print this machine's GPU stack and which "
                                 "precision settings can run here (exit 0), or check a config (exit 1 if it cannot run).")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--config", help="also check this YAML config (with key=value overrides after it)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for --config")
    args = ap.parse_args(argv)
    r = probe_environment()
    sup = precision_support(r)
    errs: list[str] = []
    if args.config:
        from nemo_fp8.config import load_config
        errs = config_support_errors(load_config(args.config, args.overrides), r)
    if args.json:
        out(json.dumps({"environment": r.to_dict(), "has_gpu": r.has_gpu,
                        "support": {k: asdict(v) for k, v in sup.items()},
                        **({"config": args.config, "config_errors": errs} if args.config else {})}, indent=2))
    else:
        out(format_report(r))
        out("")
        out(format_support_table(sup))
        if args.config:
            out("")
            out(f"config {args.config}: " + ("can run here" if not errs else "cannot run here:\n"
                                             + "\n".join(f"  - {e}" for e in errs)))
    return 1 if errs else 0


if __name__ == "__main__":
    raise SystemExit(main())
