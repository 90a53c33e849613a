"""The wheel ships every kvchat package and the built-in themes."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_kvchat_package_is_listed_in_pyproject():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kvchat").rglob("__init__.py")
    }
    assert found <= listed, f"add to pyproject's packages: {sorted(found - listed)}"


def test_builtin_themes_are_importable_resources():
    import importlib.resources

    names = {p.name for p in importlib.resources.files("kvchat.themes").iterdir()}
    assert {"dark.toml", "light.toml", "high-contrast.toml"} <= names


def test_the_kernel_sources_ship_as_package_data():
    """kvchat.native.build compiles them on the user's machine: the wheel must carry them."""
    from kvchat.native.build import HEADERS, SOURCES

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = data["package-data"]["kvchat.native"]
    for source in (*SOURCES, *HEADERS):
        assert source.exists()
        assert any(source.match(f"kvchat/native/{p}") for p in patterns)


def test_the_apps_stylesheet_ships_as_package_data():
    """The TUI reads its styles from `app.tcss` (`CSS_PATH`): the wheel must carry it."""
    from kvchat.tui.app import KvchatApp

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    stylesheet = Path(KvchatApp.CSS_PATH)
    assert stylesheet.exists()
    assert any(stylesheet.match(f"kvchat/tui/{p}") for p in data["package-data"]["kvchat.tui"])
