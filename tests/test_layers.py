"""The layers point one way: above the engine, only `kvchat.engine.api` is imported, no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvchat

ROOT = Path(kvchat.__file__).parent
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
