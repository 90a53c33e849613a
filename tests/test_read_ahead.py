"""The embedding table's read-ahead: a daemon thread reads a file-mapped tensor's pages
(through numpy, so no second torch thread pool starts) and leaves its values alone."""

from __future__ import annotations

import threading

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvchat.model.read_ahead import read_ahead


def test_a_mapped_tensor_is_read_on_a_daemon_thread_and_left_as_it_was(tmp_path):
    table = torch.randn(1000, 64).bfloat16()
    save_file({"embed": table}, str(tmp_path / "model.safetensors"))
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        mapped = f.get_tensor("embed")
    thread = read_ahead(mapped)
    assert isinstance(thread, threading.Thread) and thread.daemon
    assert thread.name == "kvchat-read-ahead"
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert torch.equal(mapped, table)


def test_nothing_starts_for_an_empty_tensor():
    assert read_ahead(torch.empty(0)) is None
