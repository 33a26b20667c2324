#!/usr/bin/env python
"""Check a run's ``metrics.jsonl`` against explicit thresholds (NeMo-RL's ``tests/check_metrics.py`` idea).

    python tools/check_metrics.py logs/suites/grpo-tiny-megatron-fp8 \\
        'count(timing/step) >= 5' 'mean(timing/step[1:]) < 40' 'max(mismatch/gen_kl_error) < 0.01'
    python tools/check_metrics.py --run fp8=logs/mission_fp8 --run bf16=logs/mission_bf16 \\
        'ratio(mean(fp8:timing/step[1:]), mean(bf16:timing/step[1:])) < 1.0'

A run is a ``metrics.jsonl`` file or a folder holding one (``logger.log_dir``); the first positional argument
is the default run unless ``--run name=path`` names the runs. A check is a comparison written like Python:

* ``key`` or ``run:key`` (e.g. ``timing/step``, ``bf16:val/accuracy``) is the series of that metric's values,
  one per row that has the key, in file order (a row per step). A missing key is an error, not a pass.
* ``key[i]`` / ``key[a:b]`` index or slice that series by position (``[1:]``: leave out the warm-up step,
  ``[-3:]``: the last three values).
* functions: ``mean``, ``median``, ``min``, ``max``, ``sum``, ``std`` (population), ``first``, ``last``,
  ``count`` of a series; ``ratio(a, b)`` = a / b; ``abs``; numbers, ``+ - * /``, ``and``, ``or``, ``not``.

Prints one table row per check (the check, the values of its sides separated by ";", PASS or FAIL) and exits 0 when every
check passes, 1 when one fails, 2 on bad input (no file, unknown key or run, a check that does not parse).
``--missing-fails`` makes an unknown run or key a FAIL row instead (a suite's share of its runs).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Callable, Sequence

from nemo_fp8.utils.logger import read_metrics

# a metric reference: optional "run:" then a key with at least one '/' (every logged metric is "section/name")
_METRIC = re.compile(r"(?:(?P<run>[A-Za-z_][\w-]*):)?(?P<key>[A-Za-z_][\w.-]*(?:/[\w.+-]+)+)")


class CheckError(ValueError):
    """A check that cannot be evaluated: bad syntax, an unknown function, run or metric key."""


class MissingError(CheckError):
    """A check naming a run or a metric key that the files lack (``--missing-fails`` makes it a FAIL row)."""


def read_rows(path: Path, by: Sequence[str] = ()) -> list[dict]:
    """The rows of ``path`` (a ``metrics.jsonl`` or a folder holding one); a line that does not parse is skipped.

    A ``.json`` file holding a list of objects (``tools/bench_rollout.py --out``, ``bench_train.py --json``)
    becomes one row whose keys are ``<the row's values of the fields by, joined by '.'>/<field>``, e.g.
    ``by=("precision",)``: ``fp8-deepgemm/fixed_tok_s``.

    Raises:
        FileNotFoundError: no such file, or a folder without ``metrics.jsonl``.
        CheckError: a ``.json`` file without ``by`` or that is not a list of objects holding every ``by`` field.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file {path} (a run's logger.log_dir holds metrics.jsonl)")
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if not by or not isinstance(data, list) or not all(isinstance(r, dict) and all(f in r for f in by)
                                                            for r in data):
            raise CheckError(f"{path}: a .json run needs --by FIELD[,FIELD] naming fields every row holds")
        return [{".".join(str(r[f]) for f in by) + "/" + k: v for r in data for k, v in r.items()}]
    return read_metrics(path)


def _series(runs: dict[str, list[dict]], default: str | None, run: str | None, key: str) -> list[float]:
    name = run or default
    if name not in runs:
        raise MissingError(f"unknown run {name!r} in {(run + ':') if run else ''}{key} (runs: {', '.join(runs)})")
    values = [float(r[key]) for r in runs[name] if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
    if not values:
        near = sorted({k for r in runs[name] for k in r if k.split("/")[0] == key.split("/")[0]})[:12]
        raise MissingError(f"run {name!r} has no metric {key!r}" + (f" (same section: {', '.join(near)})" if near else ""))
    return values


def _one(series) -> list[float]:
    if isinstance(series, (int, float)):
        return [float(series)]
    if not series:
        raise CheckError("an empty series (a slice that selects no value)")
    return list(series)


FUNCTIONS: dict[str, Callable] = {
    "mean": lambda s: statistics.fmean(_one(s)),
    "median": lambda s: statistics.median(_one(s)),
    "min": lambda s: min(_one(s)),
    "max": lambda s: max(_one(s)),
    "sum": lambda s: math.fsum(_one(s)),
    "std": lambda s: statistics.pstdev(_one(s)),
    "first": lambda s: _one(s)[0],
    "last": lambda s: _one(s)[-1],
    "count": lambda s: len(s) if isinstance(s, list) else 1,
    "ratio": lambda a, b: a / b if b else math.inf,
    "abs": abs,
}
_ALLOWED = (ast.Expression, ast.Compare, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Call, ast.Name, ast.Constant,
            ast.Subscript, ast.Slice, ast.Load, ast.And, ast.Or, ast.Not, ast.USub, ast.UAdd, ast.Add, ast.Sub,
            ast.Mult, ast.Div, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Eq, ast.NotEq)


def _parse(check: str) -> tuple[ast.Expression, list[tuple[str | None, str]]]:
    refs: list[tuple[str | None, str]] = []

    def sub(m: re.Match) -> str:
        refs.append((m.group("run"), m.group("key")))
        return f"__m{len(refs) - 1}"

    try:
        tree = ast.parse(_METRIC.sub(sub, check), mode="eval")
    except SyntaxError as e:
        raise CheckError(f"check {check!r} does not parse: {e.msg}") from None
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            raise CheckError(f"check {check!r}: {type(node).__name__} is not allowed (see the module docstring)")
        if isinstance(node, ast.Name) and node.id not in FUNCTIONS and not node.id.startswith("__m"):
            raise CheckError(f"check {check!r}: unknown name {node.id!r} (functions: {', '.join(FUNCTIONS)}; "
                             "a metric key has a '/', e.g. timing/step)")
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS):
            raise CheckError(f"check {check!r}: only {', '.join(FUNCTIONS)} can be called")
    return tree, refs


def evaluate(check: str, runs: dict[str, list[dict]], default: str | None = None) -> tuple[bool, str]:
    """Evaluate one check on ``runs`` (name -> metric rows); returns (passed, the values of its sides).

    Raises:
        CheckError: bad syntax, an unknown function, run or metric key, an empty slice.
    """
    tree, refs = _parse(check)
    env = dict(FUNCTIONS)
    for i, (run, key) in enumerate(refs):
        env[f"__m{i}"] = _series(runs, default, run, key)

    def ev(node: ast.AST):
        try:
            return eval(compile(ast.Expression(node), "<check>", "eval"), {"__builtins__": {}}, env)  # noqa: S307
        except (IndexError, TypeError, ValueError, statistics.StatisticsError, ZeroDivisionError) as e:
            raise CheckError(f"check {check!r}: {e}") from None

    body = tree.body
    passed = bool(ev(body))
    if isinstance(body, ast.Compare):
        sides = [ev(body.left)] + [ev(c) for c in body.comparators]
        shown = " ; ".join(_fmt(v) for v in sides)
    else:
        shown = _fmt(ev(body))
    return passed, shown


def _fmt(v) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v[:6]) + (", ..." if len(v) > 6 else "") + "]"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def check_all(checks: Sequence[str], runs: dict[str, list[dict]], default: str | None,
              missing_fails: bool = False) -> tuple[list, bool]:
    """Evaluate every check; returns (rows of (check, values, "PASS"/"FAIL"), all passed).

    ``missing_fails``: a check naming a run or metric the files lack is a FAIL row whose values say what is
    missing, instead of an error (a suite run on a share of its runs still prints its table and fails).

    Raises:
        CheckError: the first check that cannot be evaluated (see ``evaluate``), a missing run or metric too
            unless ``missing_fails``.
    """
    rows, ok = [], True
    for c in checks:
        try:
            passed, shown = evaluate(c, runs, default)
        except MissingError as e:
            if not missing_fails:
                raise
            passed, shown = False, f"missing: {e}"
        ok &= passed
        rows.append((c, shown, "PASS" if passed else "FAIL"))
    return rows, ok


def format_table(rows: list[tuple[str, str, str]]) -> str:
    """A markdown table of ``check_all``'s rows."""
    out = ["| check | value(s) | result |", "|---|---|---|"]
    out += [f"| `{c}` | {v} | {r} |" for c, v, r in rows]
    return "\n".join(out)


def parse_runs(specs: Sequence[str]) -> dict[str, Path]:
    """``name=path`` items -> {name: path}.

    Raises:
        CheckError: an item without ``=``, a name that is not an identifier, or a name given twice.
    """
    runs: dict[str, Path] = {}
    for s in specs:
        name, sep, path = s.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][\w-]*", name) or not path:
            raise CheckError(f"--run {s!r}: expected name=path with a name of letters, digits, '_' or '-'")
        if name in runs:
            raise CheckError(f"--run {name} given twice")
        runs[name] = Path(path)
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("items", nargs="+", help="[metrics.jsonl or log dir] then checks (without --run: the first "
                                            "item is the run)")
    p.add_argument("--run", action="append", default=[], help="name=path: a named run (repeatable)")
    p.add_argument("--by", default="", help="for a .json list of rows (benchmarks): the fields naming a row, "
                                            "e.g. precision or model,precision")
    p.add_argument("--out", help="also write the table here (markdown)")
    p.add_argument("--missing-fails", action="store_true",
                   help="a check naming a run or metric the files lack fails (a table row) instead of being an error")
    args = p.parse_intermixed_args(argv)
    try:
        paths = parse_runs(args.run)
        items = list(args.items)
        default = None
        if not paths:
            paths, default, items = {"run": Path(items[0])}, "run", items[1:]
        elif len(paths) == 1:
            default = next(iter(paths))
        if not items:
            raise CheckError("no checks given")
        by = tuple(f for f in args.by.split(",") if f)
        runs = {name: read_rows(path, by) for name, path in paths.items()}
        rows, ok = check_all(items, runs, default, missing_fails=args.missing_fails)
    except (CheckError, FileNotFoundError) as e:
        print(f"check_metrics: error: {e}", file=sys.stderr)
        return 2
    table = format_table(rows)
    print(table)
    print(f"{sum(r[2] == 'PASS' for r in rows)}/{len(rows)} checks passed")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
