"""The package's import graph (parsed with ``ast``, nothing imported): no cycles, and no import runs up the house.

Layers, bottom to top (a module may import its own layer and the layers below, never a layer above). Each layer is
whole folders or top-level modules, each section schema (``<part>/config.py``) in its part's folder:

0. foundation   ``nemo_fp8/utils/``, ``nemo_fp8/batch.py``: run folders, checkpoints, logging, the strict config
                base, metric accumulation; typed batches
1. numerics     ``nemo_fp8/fp8/``: formats, quantization, the W8A8 reference linear, KV scales; torch only
2. distributed  ``nemo_fp8/distributed/``, generic: Ray init, placement groups, the Ray fan-out, bounded teardown,
                the weight-sync transports (and the cluster / weight-sync schemas)
3. components   ``nemo_fp8/data/``, ``nemo_fp8/rewards/``, ``nemo_fp8/models/``
4. engines      ``nemo_fp8/generation/``, ``nemo_fp8/policy/``: interfaces, specs, backends (torch, vLLM, Megatron)
                and their Ray worker groups (NeMo-RL's ``lm_policy`` split)
5. algorithms   ``nemo_fp8/algorithms/``: loss, IS corrections, advantages, mismatch metrics, and the GRPO loops
                (``grpo``, ``async_grpo``) over the backend interfaces
6. assembly     ``nemo_fp8/config.py`` (MasterConfig: the sections together), ``nemo_fp8/preflight.py``,
                ``nemo_fp8/env_check.py``
7. top          ``nemo_fp8/trainer.py`` (setup -> train -> cleanup) and the package's own ``__init__``

A module is placed by its folder. Every import counts, the ones inside functions and under
``TYPE_CHECKING`` too: a lazy import is still a dependency. ``from package import name`` where ``name`` is a
module of the package is an edge to that module.

Engines. Each third-party engine package is imported only inside its backend folder (``ENGINE_HOMES``), so the
loop, the numerics and the other backends run without it: ``vllm`` in ``generation/vllm/``, ``sglang`` in
``generation/sglang/``, ``megatron`` and ``transformer_engine`` in ``policy/megatron/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nemo_fp8"

LAYERS = [
    ("foundation", ["utils/", "batch.py"]),
    ("numerics", ["fp8/"]),
    ("distributed", ["distributed/"]),
    ("components", ["data/", "rewards/", "models/"]),
    ("engines", ["generation/", "policy/"]),
    ("algorithms", ["algorithms/"]),
    ("assembly", ["config.py", "preflight.py", "env_check.py"]),
    ("top", ["trainer.py", "__init__.py"]),
]


# third-party engine package -> the one folder of nemo_fp8 that may import it
ENGINE_HOMES = {
    "vllm": "generation/vllm/",
    "sglang": "generation/sglang/",
    "megatron": "policy/megatron/",
    "transformer_engine": "policy/megatron/",
}


def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package modules it imports (see the module docstring for how names resolve)."""
    mods = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's own package upward
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods and "." in t:  # import a.b.c of a package module: its nearest module
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != mod:
                    graph[mod].add(t)
    return graph


def engine_imports(root: Path = PACKAGE) -> list[tuple[str, str]]:
    """``(module path relative to the package root, engine)`` for every import of an ``ENGINE_HOMES`` package (its
    top-level name, absolute imports only), wherever it is."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for name in names:
                top = name.split(".")[0]
                if top in ENGINE_HOMES:
                    out.append((path.relative_to(root).as_posix(), top))
    return out


def _layer_of(mod: str) -> int:
    """The layer of a package module: by its folder under ``nemo_fp8/`` (a top-level module: by its file name)."""
    parts = mod.split(".")[1:]  # drop "nemo_fp8"
    where = f"{parts[0]}/" if len(parts) > 1 or (parts and (PACKAGE / parts[0]).is_dir()) else \
        (f"{parts[0]}.py" if parts else "__init__.py")
    for i, (_, places) in enumerate(LAYERS):
        if where in places:
            return i
    raise AssertionError(f"{mod} ({where}) has no layer: add it to LAYERS in {__file__}")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "nemo_fp8.trainer" in graph and "nemo_fp8.algorithms.grpo" in graph["nemo_fp8.trainer"]
    assert "nemo_fp8.fp8.quantize" in graph["nemo_fp8.fp8.linear"]
    # a lazy import inside a function is an edge too
    assert "nemo_fp8.generation.vllm.refit" in graph["nemo_fp8.generation.vllm.engine_args"]


def test_no_cycles():
    assert _cycles(import_graph()) == []


def test_no_import_runs_up_the_house():
    ups = [f"{m} ({LAYERS[_layer_of(m)][0]}) -> {t} ({LAYERS[_layer_of(t)][0]})"
           for m, ts in sorted(import_graph().items()) for t in sorted(ts) if _layer_of(t) > _layer_of(m)]
    assert ups == []


def test_the_checks_catch_a_cycle_and_an_upward_import(tmp_path):
    pkg = tmp_path / "nemo_fp8"
    (pkg / "fp8").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "fp8" / "__init__.py").write_text("")
    (pkg / "fp8" / "a.py").write_text("from nemo_fp8.fp8 import b\n")
    (pkg / "fp8" / "b.py").write_text("def f():\n    from nemo_fp8.fp8.a import x\n    from nemo_fp8 import trainer\n")
    (pkg / "trainer.py").write_text("import os\n")
    graph = import_graph(pkg)
    assert _cycles(graph) == [["nemo_fp8.fp8.a", "nemo_fp8.fp8.b"]]
    assert "nemo_fp8.trainer" in graph["nemo_fp8.fp8.b"] and _layer_of("nemo_fp8.trainer") > _layer_of("nemo_fp8.fp8.b")


def test_engines_are_imported_only_in_their_folders():
    stray = [f"{path} imports {engine} (only {ENGINE_HOMES[engine]} may)" for path, engine in engine_imports()
             if not path.startswith(ENGINE_HOMES[engine])]
    assert stray == []
    found = {engine for _, engine in engine_imports()}
    assert {"vllm", "sglang", "megatron", "transformer_engine"} <= found  # the rule sees every engine's own imports


def test_the_engine_rule_catches_a_stray_import(tmp_path):
    pkg = tmp_path / "nemo_fp8"
    (pkg / "generation" / "sglang").mkdir(parents=True)
    (pkg / "generation" / "sglang" / "backend.py").write_text("def f():\n    from sglang.srt import x\n")
    (pkg / "generation" / "group.py").write_text("import sglang.srt.entrypoints.engine as e\nimport vllmx\n")
    (pkg / "algorithms").mkdir()
    (pkg / "algorithms" / "loss.py").write_text("def g():\n    from vllm import LLM\n    from . import sglang\n")
    got = sorted(engine_imports(pkg))
    assert got == [("algorithms/loss.py", "vllm"), ("generation/group.py", "sglang"),
                   ("generation/sglang/backend.py", "sglang")]
