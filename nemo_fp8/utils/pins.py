"""The GPU stack's pinned versions, read from their one source: ``pyproject.toml``'s extras.

``[project.optional-dependencies]`` ``vllm``, ``megatron`` and ``gpu`` hold the top-level pins
(vLLM, TransformerEngine, megatron-core, Megatron-Bridge, torch, transformers, Ray, math-verify);
``sglang`` (the second rollout engine, whose pins clash with vLLM's) is an extra of its own, outside the stack
(``extra_pins``);
``docker/constraints-gpu.txt`` holds the rest of the resolved set, each package once. Readers:
``docker/Dockerfile`` (through ``tools/pins.py``), the GPU host staging (``tools/pins.py --stage``),
``tools/check_env.py`` (installed vs pinned) and ``tests/test_container.py``.

Installed copies of the project have no ``pyproject.toml``; ``installed_stack_pins`` reads the same
extras from the package metadata (``Requires-Dist``) instead. Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PROJECT = "nemo-fp8"
STACK_EXTRAS = ("vllm", "megatron", "gpu")
# Packages of the ``megatron`` extra are installed with --no-deps: Megatron-Bridge declares dependencies
# that conflict with vLLM's (flashinfer-python 0.6.8.post1 vs 0.6.11.post2, transformers<=5.12.1).
NO_DEPS_EXTRAS = ("megatron",)
# TransformerEngine's extras pin its sub-packages at its own version (its Requires-Dist says so).
_TE_EXTRA_PACKAGES = {"core": "transformer-engine-cu12", "core-cu12": "transformer-engine-cu12",
                      "core-cu13": "transformer-engine-cu13", "pytorch": "transformer-engine-torch",
                      "jax": "transformer-engine-jax"}
# Built from source (it is published as an sdist only), against the installed torch.
BUILT_FROM_SOURCE = ("transformer-engine-torch",)

_REQ = re.compile(r"^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[(?P<extras>[^\]]*)\])?\s*"
                  r"(?P<spec>[^;]*?)\s*(?:;\s*(?P<marker>.*))?$")


def canonical(name: str) -> str:
    """PEP 503 name: lower case, runs of ``-``, ``_``, ``.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Pin:
    name: str                 # canonical
    version: str | None       # the ``==`` version; None for a requirement that is not an exact pin
    extras: tuple[str, ...] = ()
    marker: str = ""
    extra: str = ""           # which of the project's extras declared it
    requirement: str = ""     # the line as written

    def __str__(self) -> str:
        return f"{self.name}=={self.version}"


def parse_requirement(line: str, extra: str = "") -> Pin:
    m = _REQ.match(line)
    if not m:
        raise ValueError(f"cannot parse requirement {line!r}")
    spec = m["spec"].replace(" ", "")
    version = spec[2:] if spec.startswith("==") and "," not in spec else None
    extras = tuple(canonical(e) for e in (m["extras"] or "").split(",") if e.strip())
    return Pin(canonical(m["name"]), version, extras, (m["marker"] or "").strip(), extra, line.strip())


def _expand(pins: list[Pin]) -> list[Pin]:
    """Add TransformerEngine's sub-packages named by its extras (same version)."""
    out = list(pins)
    for p in pins:
        if p.name == "transformer-engine" and p.version:
            for e in p.extras:
                if e in _TE_EXTRA_PACKAGES:
                    out.append(Pin(_TE_EXTRA_PACKAGES[e], p.version, (), p.marker, p.extra, f"{p.requirement} [{e}]"))
    return out


def _flatten(extras: dict[str, list[str]], names=STACK_EXTRAS) -> list[Pin]:
    """The pins of ``names``, following self-references such as ``nemo-fp8[vllm,megatron]``, each once."""
    seen: dict[str, Pin] = {}
    todo = list(names)
    done: set[str] = set()
    while todo:
        extra = todo.pop(0)
        if extra in done:
            continue
        done.add(extra)
        for line in extras.get(extra, []):
            p = parse_requirement(line, extra)
            if p.name == PROJECT:
                todo.extend(p.extras)
            elif p.name not in seen:
                seen[p.name] = p
    return _expand(list(seen.values()))


def read_pyproject(path: str | Path) -> dict:
    import tomllib  # Python >= 3.11 (tools and tests; the package itself does not need it)
    return tomllib.loads(Path(path).read_text())


def stack_pins(pyproject: str | Path) -> list[Pin]:
    """Every pin of the GPU stack as ``pyproject.toml`` writes it (TE's sub-packages expanded)."""
    return _flatten(read_pyproject(pyproject)["project"]["optional-dependencies"])


def extra_pins(pyproject: str | Path, extra: str) -> list[Pin]:
    """The pins of one extra as ``pyproject.toml`` writes it, following ``nemo-fp8[...]`` references (e.g.
    ``sglang``: an engine staged apart from the stack, ``tools/pins.py --extra sglang``).

    Raises:
        KeyError: no such extra (the message lists them).
    """
    extras = read_pyproject(pyproject)["project"]["optional-dependencies"]
    if extra not in extras:
        raise KeyError(f"no extra {extra!r} in {pyproject} (valid: {', '.join(sorted(extras))})")
    return _flatten(extras, (extra,))


def container_platform(pyproject: str | Path) -> dict[str, str]:
    """``[tool.nemo_fp8.container]``: the Python and CUDA versions of the container."""
    return dict(read_pyproject(pyproject)["tool"]["nemo_fp8"]["container"])


def installed_stack_pins() -> list[Pin]:
    """The same pins, from the installed project's metadata; [] where the project is not installed."""
    from importlib import metadata
    try:
        reqs = metadata.requires(PROJECT) or []
    except metadata.PackageNotFoundError:
        return []
    extras: dict[str, list[str]] = {}
    for r in reqs:
        m = re.search(r"""extra\s*==\s*["']([^"']+)["']""", r)
        if not m:
            continue
        req, _, marker = r.partition(";")
        marker = re.sub(r"""\s*(and\s+)?extra\s*==\s*["'][^"']+["']""", "", marker).strip()
        marker = re.sub(r"^and\s+|\s+and$", "", marker).strip().strip("()").strip()
        extras.setdefault(canonical(m[1]), []).append(req.strip() + (f"; {marker}" if marker else ""))
    return _flatten(extras)


def read_requirements_file(path: str | Path) -> dict[str, str]:
    """``name==version`` lines (comments and blank lines ignored) as {canonical name: version}."""
    out: dict[str, str] = {}
    for raw in Path(path).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        p = parse_requirement(line)
        if p.version is None:
            raise ValueError(f"{path}: {line!r} is not an exact pin (name==version)")
        if p.name in out:
            raise ValueError(f"{path}: {p.name} appears twice")
        out[p.name] = p.version
    return out


def install_groups(pins: list[Pin]) -> dict[str, list[Pin]]:
    """How the container installs the pins: ``resolved`` (pip resolves their dependencies, under the
    constraints file), ``no-deps`` (exact packages only) and ``build`` (compiled from source)."""
    groups: dict[str, list[Pin]] = {"resolved": [], "no-deps": [], "build": []}
    for p in pins:
        if p.name in BUILT_FROM_SOURCE:
            groups["build"].append(p)
        elif p.extra in NO_DEPS_EXTRAS:
            groups["no-deps"].append(p)
        else:
            groups["resolved"].append(p)
    return groups
