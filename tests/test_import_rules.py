"""Who may import what: the layers point one way, tests share helpers, benchmarks stand alone.

Above the engine only `kvchat.engine.api` is imported, and no torch; a test module
imports helper modules, never another test module; a benchmark imports no test code.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvchat

ROOT = Path(kvchat.__file__).parent
REPO = ROOT.parent
ABOVE_ENGINE = [
    *sorted((ROOT / "chat").glob("*.py")),
    *sorted((ROOT / "tui").glob("*.py")),
    ROOT / "headless.py",
    ROOT / "ask.py",
]


def imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_the_session_layer_and_the_uis_import_only_the_engines_public_api():
    wrong = {
        f"{path.relative_to(ROOT.parent)}: {module}"
        for path in ABOVE_ENGINE
        for module in imported_modules(path)
        if (module.startswith("kvchat.engine") and module != "kvchat.engine.api")
        or module.startswith("kvchat.model")
        or module.split(".")[0] == "torch"
    }
    assert not wrong


def test_importing_the_session_layer_the_tui_and_the_engine_api_loads_no_torch():
    code = (
        "import sys, kvchat.engine.api, kvchat.chat, kvchat.tui.app, kvchat.headless\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT.parent
    )
    assert out.stdout.strip() == "False"


def test_test_modules_share_helpers_through_helper_modules_only():
    wrong = {
        f"{path.name}: {module}"
        for path in sorted((REPO / "tests").glob("*.py"))
        for module in imported_modules(path)
        if module.startswith(("tests.test_", "tests.conftest"))
    }
    assert not wrong


def test_benchmarks_import_no_test_code():
    wrong = {
        f"{path.relative_to(REPO)}: {module}"
        for path in sorted((REPO / "benchmarks").rglob("*.py"))
        for module in imported_modules(path)
        if module == "tests" or module.startswith("tests.")
    }
    assert not wrong
