#!/usr/bin/env python
"""Read the GPU suites' recipes (``examples/configs/recipes/llm/``) from a shell script.

    python tools/recipe.py get examples/configs/recipes/llm/mission-8b-4gpu/tp1.yaml grpo.max_num_steps \\
        policy.generation.max_new_tokens                    # one value a line: 4, 1024
    python tools/recipe.py overrides examples/configs/recipes/llm/arms/fp8.yaml \\
        examples/configs/recipes/llm/arms/fp8-kv-cache.yaml   # key=value a line, the later file winning

``get`` loads a recipe through the trainer's own loader (``nemo_fp8.config.load_config``: ``defaults:``
inheritance, validation), so a suite reads the values its runs will have, e.g. the step count its checks
count. ``overrides`` turns arm files (``arms/*.yaml``: a few keys that make one arm of a comparison, e.g. FP8
rollout and training on top of a BF16 layout recipe) into the ``key=value`` overrides a run takes; an arm is a
fragment, not a config, and holds scalars only.

Exit status: 0, or 2 with one line naming the file or key on a bad recipe, an unknown key, or an arm that is
not a mapping of scalars.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def recipe_values(recipe: str | Path, keys: list[str]) -> list[Any]:
    """The values of dotted ``keys`` in ``recipe`` as loaded and validated (paths made absolute).

    Raises:
        nemo_fp8.config.ConfigError: the recipe does not load or validate.
        KeyError: a key that is not in the loaded config (names it).
    """
    from nemo_fp8.config import load_config

    data = load_config(recipe).model_dump(mode="json")
    values = []
    for key in keys:
        node: Any = data
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise KeyError(f"{recipe}: no key {key}")
            node = node[part]
        values.append(node)
    return values


def _flatten(node: Any, prefix: str, path: Path) -> list[tuple[str, Any]]:
    if not isinstance(node, dict):
        if isinstance(node, list):
            raise ValueError(f"{path}: {prefix} is a list; an arm holds scalars only")
        return [(prefix, node)]
    items = []
    for key, value in node.items():
        items.extend(_flatten(value, f"{prefix}.{key}" if prefix else str(key), path))
    return items


def arm_overrides(arms: list[str | Path]) -> list[str]:
    """The ``key=value`` overrides of the arm files ``arms``, merged in order (a later file's key wins).

    Raises:
        ValueError: an arm that is not a mapping, holds a list, or has a ``defaults:`` key (an arm stands alone).
    """
    import yaml

    merged: dict[str, Any] = {}
    for arm in map(Path, arms):
        node = yaml.safe_load(arm.read_text())
        if not isinstance(node, dict):
            raise ValueError(f"{arm}: an arm is a mapping of config keys, got {type(node).__name__}")
        if "defaults" in node:
            raise ValueError(f"{arm}: an arm has no 'defaults:' (list several arms instead)")
        merged.update(_flatten(node, "", arm))
    return [f"{key}={_scalar(value)}" for key, value in merged.items()]


def _scalar(value: Any) -> str:
    """A scalar as the override parser reads it back (YAML: true, null, 2.0, fp8)."""
    return json.dumps(value) if isinstance(value, bool) or value is None else str(value)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    get = sub.add_parser("get", help="values of a recipe, one a line")
    get.add_argument("recipe")
    get.add_argument("keys", nargs="+")
    ov = sub.add_parser("overrides", help="arm files as key=value overrides, one a line")
    ov.add_argument("arms", nargs="*")
    args = p.parse_args(argv)
    try:  # ConfigError is a ValueError; `overrides` reads YAML only (no package import: a suite calls it per run)
        if args.command == "get":
            lines = [_scalar(v) for v in recipe_values(args.recipe, args.keys)]
        else:
            lines = arm_overrides(args.arms)
    except (KeyError, ValueError, OSError) as e:
        print(f"recipe.py: {str(e).strip(chr(39))}", file=sys.stderr)
        return 2
    if lines:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
