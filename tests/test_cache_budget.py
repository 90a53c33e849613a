"""Cache sizes larger than the machine are refused before anything is allocated, naming where
the size came from; the idle engine never commits memory the machine does not have."""

from __future__ import annotations

import pytest
import torch

from kvchat.cache_budget import CacheRequest, check_cpu_budget, check_gpu_budget
from kvchat.cli import main
from kvchat.engine.idle_housekeeping import TOUCH_RESERVE_BYTES, IdleHousekeeping
from kvchat.engine.tiers.kv_store import DeviceKVStore
from kvchat.errors import UsageError
from kvchat.paths import app_paths

GiB = 1 << 30


def test_a_device_cache_larger_than_the_memory_is_refused_naming_the_flag() -> None:
    request = CacheRequest(30 * GiB, 2 * GiB, "--device-cache", None)
    with pytest.raises(UsageError) as caught:
        check_cpu_budget(request, weight_bytes=GiB // 4, available_ram=24 * GiB)
    message = str(caught.value)
    assert "device cache 30.0GiB (from --device-cache)" in message
    assert "host cache 2.0GiB (from the default)" in message
    assert "24.0GiB is available" in message and "give --device-cache a smaller size" in message


def test_the_weights_count_against_the_same_memory_on_a_cpu() -> None:
    request = CacheRequest(8 * GiB, 0, "/cfg/settings.toml, line 2", "--host-cache")
    check_cpu_budget(request, weight_bytes=GiB, available_ram=12 * GiB)
    with pytest.raises(UsageError, match=r"set by /cfg/settings\.toml, line 2"):
        check_cpu_budget(request, weight_bytes=4 * GiB, available_ram=12 * GiB)


def test_on_a_gpu_the_device_cache_is_held_to_the_gpus_free_memory() -> None:
    check_gpu_budget(
        CacheRequest(10 * GiB, 4 * GiB), available_gpu=40 * GiB, available_ram=20 * GiB
    )
    with pytest.raises(UsageError, match="does not fit on the GPU"):
        check_gpu_budget(
            CacheRequest(50 * GiB, 0, "--device-cache"), available_gpu=40 * GiB, available_ram=GiB
        )
    with pytest.raises(UsageError, match="host cache does not fit"):
        check_gpu_budget(
            CacheRequest(GiB, 64 * GiB, None, "--host-cache"), available_gpu=40 * GiB,
            available_ram=32 * GiB,
        )  # fmt: skip


def test_kvchat_ask_refuses_a_huge_device_cache_with_exit_2_and_no_traceback(
    tiny_llama_dir, capsys
) -> None:
    code = main(
        ["ask", "hi", "--model", str(tiny_llama_dir), "--dtype", "float32",
         "--device-cache", "10TiB", "--host-cache", "0"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "DefaultCPUAllocator" not in err
    assert "device cache 10.0TiB (from --device-cache)" in err


def test_a_huge_size_from_the_settings_file_names_its_line(tiny_llama_dir, capsys) -> None:
    settings = app_paths().settings_file
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text('dtype = "float32"\nhost_cache = "64TiB"\n')
    code = main(["ask", "hi", "--model", str(tiny_llama_dir), "--device-cache", "16MiB"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"host cache 64.0TiB (from the settings file {settings}, line 2)" in err


def test_idle_touching_stops_before_the_machine_runs_short_of_memory() -> None:
    store = DeviceKVStore(2, 64, 16, 2, 8, torch.float32, "cpu")
    idle = IdleHousekeeping(store)
    plenty = lambda: 64 * GiB  # noqa: E731
    assert idle.next_touch(store, plenty) is not None
    short = lambda: TOUCH_RESERVE_BYTES  # noqa: E731
    assert idle.next_touch(store, short) is None
    assert idle.next_touch(store, plenty) is None  # given up for good: written pages fault in


async def test_the_tui_exits_2_when_the_cache_does_not_fit() -> None:
    from kvchat.chat.store import Store
    from kvchat.testing.tui import wait_until
    from kvchat.tui.app import KvchatApp
    from kvchat.tui.screens import FailedStartScreen

    def too_big(progress):
        raise UsageError("the KV cache does not fit in this machine's memory: ...")

    app = KvchatApp(too_big, store_factory=Store.in_memory)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, FailedStartScreen), what="screen")
        await pilot.press("q")
    assert app.return_code == 2


def test_an_allocation_the_budget_did_not_foresee_is_one_line(
    tiny_llama_dir, capsys, monkeypatch
) -> None:
    monkeypatch.setattr("kvchat.runtime.check_cache_budget", lambda *_args: None)
    code = main(
        ["ask", "hi", "--model", str(tiny_llama_dir), "--dtype", "float32",
         "--device-cache", "10TiB", "--host-cache", "0"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback" not in err
    last = err.splitlines()[-1]  # after the loading progress
    assert last.startswith("kvchat: out of memory") and "--device-cache" in last


def test_a_disk_tier_its_disk_cannot_hold_is_refused_before_anything_loads(
    tiny_llama_dir, capsys, monkeypatch
) -> None:
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(100 << 30, 29 << 30, 71 << 30))
    kv = app_paths().kv_cache_dir
    kv.mkdir(parents=True, exist_ok=True)
    (kv / "page").write_bytes(b"x" * (1 << 20))  # the tier's own files count as room
    code = main(["ask", "hi", "--model", str(tiny_llama_dir), "--disk-cache", "1TiB"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "--disk-cache: a disk tier of 1.0TiB does not fit" in err
    assert "71.0GiB free (and the tier's files use 1.0MiB)" in err and "0 to turn" in err
    settings = app_paths().settings_file
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text('disk_cache = "72GiB"\n')
    assert main(["ask", "hi", "--model", str(tiny_llama_dir)]) == 2
    assert f"the settings file {settings}, line 1: a disk tier" in capsys.readouterr().err
