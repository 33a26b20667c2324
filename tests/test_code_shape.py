"""The package's size limits (parsed with ``ast``, nothing imported): no module over ``MAX_MODULE_LINES`` lines and
no function over ``MAX_FUNCTION_LINES`` lines of code.

A function's length is its lines from ``def`` to its last statement, less its docstring (a public function's
docstring carries shapes, units, errors and sources, and may run long). Kernels, whose bodies are one unrolled
computation, would be excepted by name in ``EXCEPTED``; none is today.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nemo_fp8"
MAX_MODULE_LINES = 650
MAX_FUNCTION_LINES = 100
EXCEPTED: set[str] = set()  # "nemo_fp8/path.py:function" of a kernel, where one must be longer


def function_lengths(path: Path) -> dict[str, int]:
    """``qualified name -> lines of code`` (docstring excluded) of every function and method in ``path``."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = child.end_lineno - child.lineno + 1
                    first = child.body[0]
                    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                            and isinstance(first.value.value, str):
                        lines -= first.end_lineno - first.lineno + 1
                    out[name] = lines
                visit(child, name + ".")

    visit(ast.parse(path.read_text(), str(path)), "")
    return out


def test_no_module_is_too_long():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: split them"


def test_no_function_is_too_long():
    long = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        rel = str(p.relative_to(PACKAGE.parent))
        long.update({f"{rel}:{name}": n for name, n in function_lengths(p).items()
                     if n > MAX_FUNCTION_LINES and f"{rel}:{name}" not in EXCEPTED})
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines of code: split them"


def test_the_lengths_count_code_not_docstrings(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f'def short():\n    """Doc\n    on\n    lines."""\n    return 1\n\n\n'
                                   f"class C:\n    def long(self):\n{body}\n")
    assert function_lengths(tmp_path / "m.py") == {"short": 2, "C.long": MAX_FUNCTION_LINES + 1}
