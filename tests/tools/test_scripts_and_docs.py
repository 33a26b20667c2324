"""The house around the package: scripts import the installed package (no sys.path edits), the console script
resolves, the README stays a quick start, and every suite the README and docs/ name exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUITES = {p.stem for p in (REPO / "tests" / "test_suites" / "llm").glob("*.sh")}


def test_scripts_do_not_edit_sys_path():
    scripts = sorted((REPO / "tools").rglob("*.py")) + sorted((REPO / "examples").rglob("*.py"))
    assert scripts
    offenders = [str(p.relative_to(REPO)) for p in scripts if re.search(r"sys\.path\.(insert|append)", p.read_text())]
    assert offenders == []


def test_console_script_resolves_to_the_environment_report():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts["nemo-fp8-check-env"].partition(":")
    main = getattr(importlib.import_module(module), func)
    from nemo_fp8.env_check import main as env_main

    assert main is env_main and callable(main)


def test_readme_is_a_quick_start():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    ci = (REPO / ".ci" / "run").read_text()
    # the README's test command is what CI runs (CI adds pip's -q)
    assert "pip install -q torch==2.13.0 && pip install -q -e \".[dev]\" && python -m pytest -q" in ci
    assert "pip install torch==2.13.0 && pip install -e \".[dev]\" && python -m pytest -q" in readme
    assert "Performance (4-GPU mission suite)" in readme


def test_every_named_suite_exists():
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "docs" / "results" / "README.md"]
    named = set()
    for doc in docs:
        text = doc.read_text()
        named |= set(re.findall(r"tests/test_suites/llm/([\w-]+)\.sh", text))
        # a table cell or sentence naming a suite in backticks: `grpo-tiny-megatron-fp8`
        named |= {n for n in re.findall(r"`([a-z0-9]+(?:-[a-z0-9]+)+)`", text)
                  if n.startswith(("gpu-tests", "grpo-tiny", "bench-", "profile-", "parity-", "bf16-lr", "mission-"))}
    assert named, "the docs name no suite"
    assert sorted(named - SUITES) == []
