"""Theme files: kvchat's own load, a broken user file is a notification, the choice persists."""

from __future__ import annotations

from types import MappingProxyType

from kvchat.chat.settings import Settings, load_settings
from kvchat.paths import app_paths
from kvchat.testing.tui import fake_app, ready, wait_until
from kvchat.tui.themes import builtin_theme_files, load_themes, parse_theme

GOOD = 'name = "mine"\nprimary = "#123456"\nbackground = "#000000"\n'


def test_builtin_themes_include_dark_light_and_high_contrast():
    loaded = load_themes(None)
    names = {t.name for t in loaded.themes}
    assert {"kvchat-dark", "kvchat-light", "kvchat-high-contrast"} <= names
    assert loaded.problems == ()
    assert len(builtin_theme_files()) >= 3
    light = next(t for t in loaded.themes if t.name == "kvchat-light")
    assert light.dark is False


def test_broken_user_theme_is_a_problem_and_the_others_load(tmp_path):
    (tmp_path / "good.toml").write_text(GOOD, encoding="utf-8")
    (tmp_path / "bad-color.toml").write_text('name = "x"\nprimary = "nope"\n', encoding="utf-8")
    (tmp_path / "bad-toml.toml").write_text("name = \n", encoding="utf-8")
    loaded = load_themes(tmp_path)
    assert "mine" in {t.name for t in loaded.themes}
    assert len(loaded.problems) == 2
    assert any("bad-color.toml" in p and "not a color" in p for p in loaded.problems)
    assert any("bad-toml.toml" in p and "TOML" in p for p in loaded.problems)


def test_parse_theme_names_unknown_keys():
    try:
        parse_theme(GOOD + 'colour = "#fff"\n', "t.toml")
    except Exception as exc:
        assert "colour" in str(exc)
    else:
        raise AssertionError("an unknown key must be refused")


async def test_broken_theme_notifies_and_chosen_theme_persists(tmp_path):
    themes_dir = app_paths().themes_dir
    themes_dir.mkdir(parents=True)
    (themes_dir / "mine.toml").write_text(GOOD, encoding="utf-8")
    (themes_dir / "broken.toml").write_text('name = "b"\nprimary = 3\n', encoding="utf-8")
    app, _ = fake_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot, app)
        assert any("broken.toml" in n.message for n in app._notifications)
        assert "mine" in app.available_themes
        app.theme = "kvchat-high-contrast"
        await wait_until(pilot, lambda: load_settings().theme == "kvchat-high-contrast")
    app2, _ = fake_app(settings=load_settings())
    async with app2.run_test(size=(120, 40)) as pilot:
        await ready(pilot, app2)
        assert app2.theme == "kvchat-high-contrast"


def test_the_readme_names_the_built_in_themes_as_the_settings_file_takes_them() -> None:
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    themes_line = next(line for line in readme.splitlines() if "Themes:" in line)
    paragraph = readme[readme.index(themes_line) :].split("\n\n")[0]
    named = set(re.findall(r"`(kvchat-[a-z-]+)`", paragraph))
    built_in = {theme.name for theme in load_themes(None).themes}
    assert named == built_in


def test_every_built_in_theme_has_borders_and_text_that_stand_out() -> None:
    """WCAG's bars: 3:1 for a panel's border and the accents drawn as borders and
    titles, 4.5:1 for text (states are written in the warning and success colors)."""
    from kvchat.tui.themes import contrast_ratio, panel_border

    for theme in load_themes(None).themes:
        variables = {**theme.to_color_system().generate(), **theme.variables}
        background = variables["background"]
        checks = {
            "panel border": (panel_border(variables), 3.0),
            "primary": (variables["primary"], 3.0),
            "foreground": (variables["foreground"], 4.5),
            "warning": (variables["warning"], 4.5),
            "success": (variables["success"], 4.5),
            "error": (variables["error"], 4.5),
        }
        for what, (color, bar) in checks.items():
            ratio = contrast_ratio(color, background)
            assert ratio >= bar, f"{theme.name}: {what} {color} on {background}: {ratio:.2f}"


async def test_the_panels_are_drawn_with_the_themes_panel_border():
    from textual.color import Color

    from kvchat.tui.themes import panel_border

    app, _ = fake_app(settings=Settings(theme="kvchat-light"))
    async with app.run_test(size=(150, 45)) as pilot:
        await ready(pilot, app)
        expected = Color.parse(panel_border(app.get_css_variables()))
        for panel in (app.chat.sidebar, app.chat.transcript, app.chat.meters):
            assert panel.styles.border_top[1] == expected


async def test_a_theme_not_installed_names_where_it_was_set_and_the_themes_there_are():
    settings = Settings(theme="light", sources=MappingProxyType({"theme": "settings.toml, line 3"}))
    app, _ = fake_app(settings=settings)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot, app)
        (said,) = [n.message for n in app._notifications if "'light'" in n.message]
        assert "(settings.toml, line 3) is not installed; using kvchat-dark." in said
        for name in ("kvchat-dark", "kvchat-light", "kvchat-high-contrast"):
            assert name in said


def test_the_theme_flag_wins_over_the_settings_file_for_one_run():
    from kvchat.cli import build_parser
    from kvchat.tui.main import with_theme_flag

    settings = Settings(theme="kvchat-dark")
    args = build_parser().parse_args(["chat", "--theme", "kvchat-light"])
    chosen = with_theme_flag(settings, args)
    assert (chosen.theme, chosen.sources["theme"]) == ("kvchat-light", "--theme")
    assert with_theme_flag(settings, build_parser().parse_args(["chat"])) == settings
