"""`kvchat cache`, `kvchat cache clear`, the `disk_cache` setting and `--disk-cache`."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvchat.chat.settings import parse_settings
from kvchat.cli import main
from kvchat.engine.cache.page_hash import page_hash, root_salt
from kvchat.engine.tiers.disk_page import DiskPageFormat
from kvchat.engine.tiers.disk_tier import DiskTier
from kvchat.paths import app_paths
from kvchat.runtime import disk_cache_bytes, engine_config, resolve_options


def write_pages(n: int, model: str) -> None:
    salt = root_salt(model, "bfloat16", "native")
    fmt = DiskPageFormat(salt, 4, 1, 1, 2, "bfloat16", "native")
    tier = DiskTier(app_paths().kv_cache_dir, fmt, 1 << 20)
    parent = salt
    for i in range(n):
        tokens = tuple(range(4 * i, 4 * i + 4))
        h = page_hash(parent, tokens)
        parts = [torch.zeros(1, 4, 1, 2, dtype=torch.bfloat16) for _ in range(2)]
        tier.save(h, parent, tokens, parts)
        parent = h
    tier.close()


def test_cache_shows_sizes_and_the_disk_tiers_use_and_clear_empties_it(capsys) -> None:
    write_pages(3, "model-a")
    write_pages(2, "model-b")
    assert main(["cache", "--device-cache", "512MiB", "--host-cache", "0"]) == 0
    out = capsys.readouterr().out
    assert "device tier  512.0MiB" in out and "host tier    off" in out
    assert "5 pages" in out and "2 model(s)" in out and str(app_paths().kv_cache_dir) in out
    assert main(["cache", "clear"]) == 0
    assert "Removed 5 pages" in capsys.readouterr().out
    assert main(["cache"]) == 0
    assert "0 pages" in capsys.readouterr().out


def test_paths_lists_the_kv_cache_folder(capsys) -> None:
    assert main(["paths"]) == 0
    assert str(app_paths().kv_cache_dir) in capsys.readouterr().out


def test_disk_cache_setting_flag_and_default() -> None:
    settings = parse_settings('disk_cache = "2GiB"\n', Path("settings.toml"))
    assert settings.disk_cache == 2 << 30
    args = argparse.Namespace(disk_cache=None)
    assert resolve_options(args, settings).disk_cache == 2 << 30
    off = resolve_options(argparse.Namespace(disk_cache="0"), settings)
    assert engine_config(off).disk_cache_bytes == 0  # the flag wins; 0 turns the tier off
    default = resolve_options(argparse.Namespace(), parse_settings("", Path("s.toml")))
    assert 0 < disk_cache_bytes(default) <= 8 << 30


def test_a_bad_disk_cache_size_is_one_clear_line(capsys) -> None:
    assert main(["cache", "--disk-cache", "lots"]) == 2  # bad input
    err = capsys.readouterr().err
    assert "'lots' is not a size" in err and "Traceback" not in err
