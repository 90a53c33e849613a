"""Theme files (TOML) turned into Textual `Theme` objects: kvchat's own and the user's.

Why data files: a theme is a handful of colors, and users should be able to add
one without writing Python (posting does the same). kvchat's themes ship in the
wheel as the package `kvchat.themes` (the top-level `themes/` folder of the
repository); a source checkout that is not installed reads that folder directly.
User themes live in `app_paths().themes_dir`. A broken file never stops kvchat:
`load_themes` returns it as a problem for the UI to show, and the others load.
"""

from __future__ import annotations

import importlib.resources
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from pathlib import Path

from textual.color import Color, ColorParseError
from textual.theme import Theme

from kvchat.errors import KvchatError

DEFAULT_THEME = "kvchat-dark"

_COLOR_KEYS = (
    "primary",
    "secondary",
    "accent",
    "foreground",
    "background",
    "surface",
    "panel",
    "boost",
    "success",
    "warning",
    "error",
)
_FLOAT_KEYS = ("luminosity_spread", "text_alpha")
_KNOWN_KEYS = frozenset({"name", "dark", "variables", *_COLOR_KEYS, *_FLOAT_KEYS})


class ThemeFileError(KvchatError):
    """A theme file that cannot be turned into a theme; the message names the file."""


@dataclass(frozen=True)
class LoadedThemes:
    themes: tuple[Theme, ...]
    problems: tuple[str, ...]  # one line per broken file, for a notification


def builtin_theme_files() -> list[Traversable]:
    """kvchat's own theme files: the installed package's, else the checkout's `themes/`."""
    try:
        root: Traversable = importlib.resources.files("kvchat.themes")
    except ModuleNotFoundError:
        root = Path(__file__).resolve().parents[2] / "themes"
    try:
        return sorted((f for f in root.iterdir() if f.name.endswith(".toml")), key=lambda f: f.name)
    except (FileNotFoundError, NotADirectoryError):
        return []


def parse_theme(text: str, source: str) -> Theme:
    """A `Theme` from TOML text; `ThemeFileError` saying what is wrong and where."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ThemeFileError(f"{source}: not valid TOML ({exc})") from None
    unknown = sorted(set(data) - _KNOWN_KEYS)
    if unknown:
        raise ThemeFileError(f"{source}: unknown key(s) {', '.join(unknown)}")
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ThemeFileError(f'{source}: needs a name, like name = "my-theme"')
    if "primary" not in data:
        raise ThemeFileError(f'{source}: needs a primary color, like primary = "#4ea1ff"')
    colors: dict[str, str] = {}
    for key in _COLOR_KEYS:
        if key in data:
            colors[key] = _color(data[key], f"{source}: {key}")
    variables = data.get("variables", {})
    if not isinstance(variables, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in variables.items()
    ):
        raise ThemeFileError(f"{source}: [variables] must map names to color strings")
    dark = data.get("dark", True)
    if not isinstance(dark, bool):
        raise ThemeFileError(f"{source}: dark must be true or false")
    floats: dict[str, float] = {}
    for key in _FLOAT_KEYS:
        if key in data:
            value = data[key]
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= 1:
                raise ThemeFileError(f"{source}: {key} must be a number from 0 to 1")
            floats[key] = float(value)
    theme = Theme(name=name.strip(), dark=dark, variables=dict(variables), **colors, **floats)  # type: ignore[arg-type]
    try:
        theme.to_color_system().generate()
    except Exception as exc:  # Textual's own validation of the whole palette
        raise ThemeFileError(f"{source}: {exc}") from None
    return theme


def _color(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ThemeFileError(f'{where} must be a color string, like "#4ea1ff"')
    try:
        Color.parse(value)
    except ColorParseError:
        raise ThemeFileError(f'{where}: {value!r} is not a color (use "#rrggbb")') from None
    return value


def load_themes(
    user_dir: Path | None, builtin: Iterable[Traversable] | None = None
) -> LoadedThemes:
    """kvchat's themes, then the user's (a user theme may replace one of the same name)."""
    themes: dict[str, Theme] = {}
    problems: list[str] = []
    files: list[tuple[Traversable, str]] = [
        (f, f"built-in theme {f.name}")
        for f in (builtin if builtin is not None else builtin_theme_files())
    ]
    if user_dir is not None and user_dir.is_dir():
        files += [(f, str(f)) for f in sorted(user_dir.glob("*.toml"))]
    for file, source in files:
        try:
            text = file.read_text(encoding="utf-8")
            theme = parse_theme(text, source)
        except ThemeFileError as exc:
            problems.append(str(exc))
            continue
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(f"{source}: cannot read it ({exc})")
            continue
        themes[theme.name] = theme
    return LoadedThemes(tuple(themes.values()), tuple(problems))


# The panels' borders: halfway from the background to the text, so that they stand out
# at 3:1 or more on any theme with readable text (WCAG's bar for a component's edge);
# `$panel-lighten-2` disappeared on a light background. A theme may set its own.
PANEL_BORDER = "panel-border"


def panel_border(variables: dict[str, str]) -> str:
    """The panel border color for a theme's generated variables (`background`,
    `foreground`), unless the theme names one."""
    if PANEL_BORDER in variables:
        return variables[PANEL_BORDER]
    background = Color.parse(variables["background"])
    foreground = Color.parse(variables["foreground"])
    return background.blend(foreground, 0.5).hex


class PanelBorderVariable:
    """Mixed into an `App` that uses kvchat's stylesheet: adds `$panel-border` for
    whatever theme is active (kvchat's, the user's, or Textual's own)."""

    def get_css_variables(self) -> dict[str, str]:
        variables = super().get_css_variables()  # type: ignore[misc]
        return {**variables, PANEL_BORDER: panel_border(variables)}


def contrast_ratio(a: str, b: str) -> float:
    """WCAG's contrast ratio of two opaque colors (1 to 21)."""

    def luminance(color: Color) -> float:
        def channel(v: int) -> float:
            x = v / 255
            return x / 12.92 if x <= 0.03928 else ((x + 0.055) / 1.055) ** 2.4

        return 0.2126 * channel(color.r) + 0.7152 * channel(color.g) + 0.0722 * channel(color.b)

    la, lb = luminance(Color.parse(a)), luminance(Color.parse(b))
    return (max(la, lb) + 0.05) / (min(la, lb) + 0.05)
