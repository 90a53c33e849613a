"""`kvchat cache`: the KV cache tiers' configured sizes and the disk tier's use; `cache clear`.

The device and host tiers live only while kvchat runs, so this shows the sizes they
would get (from the command line, the settings file, or the defaults); the disk tier
is a folder, so this shows what is in it: pages, bytes, and how many models (salts)
they belong to.
"""

from __future__ import annotations

import argparse

from kvchat.engine.tiers.disk_tier import clear_folder, folder_usage
from kvchat.paths import app_paths
from kvchat.runtime import disk_cache_bytes, read_settings, resolve_options
from kvchat.units import format_size


def _sizes(args: argparse.Namespace) -> tuple[str, str, str]:
    options = resolve_options(args, read_settings())
    if options.device_cache is None or options.host_cache is None:
        import torch

        from kvchat.engine.config import default_cache_bytes

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        default_device, default_host = default_cache_bytes(device)
    else:
        default_device = default_host = 0

    def show(value: int | None, default: int, what: str) -> str:
        if value is None:
            return f"{format_size(default)} (default: {what})"
        return "off" if value == 0 else format_size(value)

    disk = disk_cache_bytes(options)
    disk_text = "off" if disk == 0 else format_size(disk)
    if options.disk_cache is None:
        disk_text += " (default: 8GiB or a tenth of the free disk, the smaller)"
    return (
        show(options.device_cache, default_device, "from free memory"),
        show(options.host_cache, default_host, "from free memory"),
        disk_text,
    )


def run_cache(args: argparse.Namespace) -> int:
    folder = app_paths().kv_cache_dir
    if args.action == "clear":
        removed = clear_folder(folder)
        print(
            f"Removed {removed.pages:,} pages ({format_size(removed.bytes)}) of "
            f"{removed.models} model(s) from {folder}."
        )
        return 0
    device, host, disk = _sizes(args)
    usage = folder_usage(folder)
    print(f"device tier  {device}")
    print(f"host tier    {host}")
    print(f"disk tier    {disk}")
    print(
        f"disk folder  {folder}: {usage.pages:,} pages, {format_size(usage.bytes)}, "
        f"{usage.models} model(s)"
    )
    return 0
