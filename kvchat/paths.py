"""Where kvchat keeps its files (platformdirs), in one place so `kvchat paths` can list them.

`KVCHAT_HOME` overrides everything (tests and portable installs use it): the
data, config, cache and log folders become subfolders of it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

APP_NAME = "kvchat"


@dataclass(frozen=True)
class AppPaths:
    data_dir: Path
    config_dir: Path
    cache_dir: Path
    log_dir: Path

    @property
    def database(self) -> Path:
        return self.data_dir / "sessions.sqlite3"

    @property
    def settings_file(self) -> Path:
        return self.config_dir / "settings.toml"

    @property
    def themes_dir(self) -> Path:
        return self.config_dir / "themes"

    @property
    def models_dir(self) -> Path:
        return self.cache_dir / "models"

    @property
    def kv_cache_dir(self) -> Path:
        """The KV cache's disk tier: one file per page, named by its salted hash."""
        return self.cache_dir / "kv"

    @property
    def error_log(self) -> Path:
        return self.log_dir / "errors.log"


def app_paths() -> AppPaths:
    """The folders for this user, honouring `KVCHAT_HOME` when it is set."""
    home = os.environ.get("KVCHAT_HOME")
    if home:
        root = Path(home)
        return AppPaths(root / "data", root / "config", root / "cache", root / "log")
    return AppPaths(
        Path(platformdirs.user_data_dir(APP_NAME)),
        Path(platformdirs.user_config_dir(APP_NAME)),
        Path(platformdirs.user_cache_dir(APP_NAME)),
        Path(platformdirs.user_log_dir(APP_NAME)),
    )
