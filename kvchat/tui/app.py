"""`KvchatApp`: the Textual application: theme, settings, the backend, the chat screen.

Threads (harlequin's and toolong's rule): the engine and the service run on
their own threads and never touch a widget. The model loads in a thread worker
behind `StartupScreen`; a `KvchatError` from it shows `FailedStartScreen`. Once it
is loaded, the app builds the `SessionService` and shows the `ChatScreen` over it,
which owns the widgets, the frame pump and everything about the sessions. Switching
the model (f5) loads the new backend in a thread worker beside the running one.

Why the UI's cost matters, and what the frame pump does about it: docs/tui.md. The
GIL's switch interval is 1 ms while the app runs (`GIL_SWITCH_INTERVAL_S`, Python's
default 5 ms restored at exit): between two torch ops the engine thread needs the GIL
back for microseconds of Python, and when the UI thread holds it in a screen update
the engine waits until the interval forces a hand-over (measured: docs/tui.md).

What is still unsaved at quit is written to a recovery file (`shutdown` keeps its
report in `unsaved`, `run_tui` prints it and exits 1). Every action catches
`KvchatError` and shows its message as a notification; anything else is logged to
the error log and reported in one line (`guarded`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from textual import work
from textual.app import App, SystemCommand
from textual.screen import Screen

from kvchat.chat.error_log import log_exception
from kvchat.chat.recovery import UnsavedReport
from kvchat.chat.service import SessionService
from kvchat.chat.settings import Settings, save_setting
from kvchat.chat.store import Store
from kvchat.errors import KvchatError, UsageError
from kvchat.paths import app_paths
from kvchat.tui.backend import BackendFactory, TuiBackend
from kvchat.tui.chat_screen import ChatScreen
from kvchat.tui.guarded import log_failure, notify_failure
from kvchat.tui.keys import GLOBAL_KEYS, bindings, check_keymap, install_meta_digit_keys
from kvchat.tui.messages import (
    BackendReady,
    BackendSwitched,
    ModelsListed,
    StartFailed,
    StartProgress,
)
from kvchat.tui.model_picker import ModelPicker
from kvchat.tui.screens import FailedStartScreen, StartupScreen
from kvchat.tui.session_search import SessionSearch
from kvchat.tui.themes import DEFAULT_THEME, PanelBorderVariable, load_themes

GIL_SWITCH_INTERVAL_S = 0.001  # while the app runs (see the module docstring)


class KvchatApp(PanelBorderVariable, App[int]):
    """Loads the backend and shows the chat screen over it (see the module docstring)."""

    CSS_PATH = Path(__file__).parent / "app.tcss"
    TITLE = "kvchat"
    COMMANDS = App.COMMANDS | {SessionSearch}  # the palette also finds sessions
    BINDINGS = bindings(GLOBAL_KEYS, priority=True)  # quit and the palette (see `check_action`)
    ENABLE_COMMAND_PALETTE = True
    COMMAND_PALETTE_BINDING = "ctrl+backslash"  # ours has an id (command_palette)

    def __init__(
        self,
        backend_factory: BackendFactory,
        *,
        settings: Settings | None = None,
        settings_problem: str | None = None,
        store_factory: Callable[[], Store] | None = None,
        user_themes_dir: Path | None = None,
    ) -> None:
        super().__init__()
        install_meta_digit_keys()  # alt+1..9 in tmux and screen (see the function)
        self._switch_interval_before = sys.getswitchinterval()  # restored at unmount
        self.settings = settings or Settings()
        self.backend_factory = backend_factory
        self.store_factory = store_factory or (lambda: Store(app_paths().database))
        self.user_themes_dir = (
            user_themes_dir if user_themes_dir is not None else app_paths().themes_dir
        )
        self.problems: list[str] = [settings_problem] if settings_problem else []
        self.keymap, key_problems = check_keymap(self.settings.keys, self.settings.sources)
        self.problems += key_problems
        self.set_keymap(self.keymap)
        self.backend: TuiBackend | None = None
        self.service: SessionService | None = None
        self.chat: ChatScreen | None = None  # shown once the backend is ready
        self._themes_ready = False
        self.exit_code = 0
        self.unsaved: UnsavedReport | None = None  # what `shutdown` could not store
        self._load_themes()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Quit works on every screen; the palette only over the chat screen (not over a
        dialog, nor while kvchat starts)."""
        if action == "command_palette":
            return self.chat is not None and self.screen is self.chat
        return True

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """The chat screen's actions by name; only Quit before it is up."""
        if self.chat is None:
            yield SystemCommand("Quit", "quit kvchat", self.action_quit)
            return
        yield from self.chat.system_commands()

    # ---------------------------------------------------------------- themes

    def _load_themes(self) -> None:
        loaded = load_themes(self.user_themes_dir)
        for theme in loaded.themes:
            self.register_theme(theme)
        self.problems += [f"Theme not loaded: {p}" for p in loaded.problems]
        wanted = self.settings.theme or DEFAULT_THEME
        if wanted not in self.available_themes:
            where = self.settings.sources.get("theme", "the settings file")
            kvchat_themes = ", ".join(t.name for t in loaded.themes)
            self.problems.append(
                f"Theme {wanted!r} ({where}) is not installed; using {DEFAULT_THEME}. "
                f"kvchat's themes: {kvchat_themes} (ctrl+p lists Textual's too)."
            )
            wanted = DEFAULT_THEME
        if wanted in self.available_themes:
            self.theme = wanted

    def _theme_changed(self, theme: Any) -> None:
        if not self._themes_ready or theme.name == (self.settings.theme or DEFAULT_THEME):
            return
        try:
            save_setting("theme", theme.name)
            self.settings = replace(self.settings, theme=theme.name)
        except KvchatError as exc:
            self.notify(f"The theme is not saved: {exc}", severity="warning")

    # --------------------------------------------------------------- start-up

    def on_mount(self) -> None:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self.theme_changed_signal.subscribe(self, self._theme_changed)
        self._themes_ready = True
        for problem in self.problems:
            self.notify(problem, severity="warning", timeout=10)
        self.push_screen(StartupScreen(self.keymap))
        self._start()

    @work(thread=True, exit_on_error=False, group="startup")
    def _start(self) -> None:
        """Thread worker: load the model, open the store, build the service."""
        backend: TuiBackend | None = None
        try:
            backend = self.backend_factory(lambda line: self.post_message(StartProgress(line)))
            store = self.store_factory()
            chat = backend.chat
            service = SessionService(chat.engine, chat.renderer, store, **backend.service_options())
        except KvchatError as exc:
            self._close_backend(backend)
            self.post_message(StartFailed(str(exc), 2 if isinstance(exc, UsageError) else 1))
            return
        except Exception as exc:
            log_exception("kvchat could not start")
            self._close_backend(backend)
            self.post_message(
                StartFailed(
                    f"An unexpected error stopped the start: {exc}\n\n"
                    f"The details are in {app_paths().error_log}; "
                    "please include them in a bug report."
                )
            )
            return
        self.post_message(BackendReady(backend, service, store.interrupted_on_open))

    @staticmethod
    def _close_backend(backend: TuiBackend | None) -> None:
        if backend is not None:
            try:
                backend.close()
            except Exception:
                log_exception("closing the engine after a failed start")

    def on_start_progress(self, message: StartProgress) -> None:
        if isinstance(self.screen, StartupScreen):
            self.screen.progress(message.line)

    def on_start_failed(self, message: StartFailed) -> None:
        self.exit_code = message.exit_code
        text = message.text
        typed = self.screen.typed if isinstance(self.screen, StartupScreen) else ""
        if typed.strip():  # shown, so that it can be copied: nothing typed is lost
            text += f"\n\nWhat you typed while kvchat was starting (not sent):\n{typed}"
        self._replace_startup_with(FailedStartScreen(text))

    def _replace_startup_with(self, screen: Screen) -> None:
        if isinstance(self.screen, StartupScreen):
            self.switch_screen(screen)
        else:
            self.push_screen(screen)

    def on_backend_ready(self, message: BackendReady) -> None:
        """The chat screen over the new service, with what was typed while starting."""
        self.backend = message.backend
        self.service = message.service
        typed, send_typed = "", False
        if isinstance(self.screen, StartupScreen):
            typed, send_typed = self.screen.typed, self.screen.send_queued
        self.chat = ChatScreen(
            message.service,
            message.backend,
            self.keymap,
            typed_at_start=typed,
            send_typed=send_typed,
            interrupted=message.interrupted,
            switch_model=self.switch_model,
        )
        self._replace_startup_with(self.chat)

    async def on_unmount(self) -> None:
        self.shutdown()
        sys.setswitchinterval(self._switch_interval_before)

    def shutdown(self) -> None:
        """Stop the chat screen, close the service (writes pending text) and the engine."""
        if self.chat is not None:
            self.chat.close()
        if self.service is not None:
            try:
                self.unsaved = self.service.close()
            except Exception:
                log_exception("closing the session service")
            if self.unsaved is not None:
                self.exit_code = 1
            self.service = None
        self._close_backend(self.backend)
        self.backend = None

    # ---------------------------------------------------------------- models

    def switch_model(self) -> None:
        """f5: the models on this machine; the one chosen serves every later turn."""
        if self.backend is None or self.service is None:
            return
        if self.backend.switch is None:
            self.notify(
                "This engine serves its own model (a remote server): restart kvchat with "
                "--model to run another.",
                severity="warning",
            )
            return
        self._list_models(self.backend)

    @work(thread=True, exit_on_error=False, group="models")
    def _list_models(self, backend: TuiBackend) -> None:
        try:
            choices = backend.models()
        except Exception as exc:
            log_failure(exc, "listing the models")
            self.call_from_thread(notify_failure, self, exc)
            return
        self.post_message(ModelsListed(choices))

    def on_models_listed(self, message: ModelsListed) -> None:
        if not message.choices:
            self.notify("No models found on this machine besides the one running.")
            return
        self.push_screen(ModelPicker(message.choices), self._model_chosen)

    def _model_chosen(self, name: str | None) -> None:
        if name is None or self.backend is None or self.service is None:
            return
        if self.chat is not None and self.chat.sessions.busy():
            self.notify(
                "A reply is on the way: let it finish (or stop it with esc), then switch.",
                severity="warning",
            )
            return
        self.notify(f"Loading {name}… (the current model serves until it is ready)")
        self._switch_model(self.backend, self.service, name)

    @work(thread=True, exit_on_error=False, group="switch-model", exclusive=True)
    def _switch_model(self, old: TuiBackend, service: SessionService, name: str) -> None:
        """Thread worker: load `name`'s backend beside the running one, hand the sessions
        to it, then close the old one (a failure leaves the old one serving)."""
        assert old.switch is not None
        new: TuiBackend | None = None
        try:
            new = old.switch(name, lambda _line: None)
            service.replace_backend(new.chat.engine, new.chat.renderer, **new.service_options())
        except Exception as exc:
            self._close_backend(new)
            if not isinstance(exc, KvchatError):
                log_failure(exc, "switching the model")
            self.call_from_thread(
                self.notify, f"Could not switch to {name}: {exc}", severity="error", timeout=15
            )
            return
        self._close_backend(old)
        self.post_message(BackendSwitched(new, name))

    def on_backend_switched(self, message: BackendSwitched) -> None:
        self.backend = message.backend
        if self.chat is not None:
            self.chat.backend_switched(message.backend, message.name)

    async def action_quit(self) -> None:
        self.exit(self.exit_code, return_code=self.exit_code)
