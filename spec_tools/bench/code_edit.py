"""The code-edit workload (`spec bench --dataset code-edit`): edit instructions over real code, each with
the original code as its Predicted Output, the case OpenAI's `prediction` parameter is for.

The code is the functions of 30 to 150 lines in Python's own standard-library sources, which every
machine with Python has: nothing is downloaded or copied into the repository. Each prompt asks for one
small, mechanical edit (rename a local variable, add a docstring, add a comment before the first
return) and the whole function back in a code block; the prediction is the function as it stands, in
the same block. Which functions and edits are picked depends on the seed alone.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path
from typing import Iterator, Optional

from spec_tools.bench import BenchError

MIN_LINES, MAX_LINES = 30, 150
CATEGORY = "code-edit"


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def functions(root: Path) -> Iterator[tuple[str, str, ast.FunctionDef]]:
    """(name, source, node) of each top-level function or method of MIN_LINES..MAX_LINES lines."""
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
                n = node.end_lineno - node.lineno + 1
                if MIN_LINES <= n <= MAX_LINES and not node.decorator_list:
                    body = lines[node.lineno - 1:node.end_lineno]
                    indent = len(body[0]) - len(body[0].lstrip())
                    yield f"{path.stem}.{node.name}", "\n".join(line[indent:] for line in body), node


def _edit(node: ast.FunctionDef, rng: random.Random) -> Optional[str]:
    """An instruction for a small edit of this function, or None when none fits."""
    stored = sorted({n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
                     and len(n.id) > 2})
    options = []
    if stored:
        name = rng.choice(stored)
        options.append(f"Rename the local variable `{name}` to `{name}_value` everywhere in this function.")
    if ast.get_docstring(node) is None:
        options.append("Add a short docstring that says what this function does.")
    if any(isinstance(n, ast.Return) for n in ast.walk(node)):
        options.append("Add a one-line comment above the first `return` statement that says what it returns.")
    return rng.choice(options) if options else None


def code_edit_rows(n: Optional[int], seed: int = 0, root: Optional[Path] = None) -> list[tuple[str, str, str]]:
    """(id, prompt, prediction) for up to n edits (all candidates when None)."""
    root = root or stdlib_dir()
    found = list(functions(root))
    if not found:
        raise BenchError(f"No functions of {MIN_LINES}-{MAX_LINES} lines in {root}: the code-edit workload reads "
                         "Python's standard-library sources, which this Python does not have.")
    rng = random.Random(seed)
    rng.shuffle(found)
    rows = []
    for name, source, node in found:
        instruction = _edit(node, rng)
        if instruction is None:
            continue
        block = f"```python\n{source}\n```"
        rows.append((name, f"{instruction} Reply with the whole edited function in one python code block and "
                           f"nothing else.\n\n{block}", block))
        if n is not None and len(rows) == n:
            break
    return rows
