"""A session database kvchat may not write: the message names the path and the permission
problem, never the advice for a damaged file ("move it away")."""

from __future__ import annotations

import os
import sqlite3
import stat

import pytest

import kvchat.chat.store as store_module
from kvchat.chat.database_access import access_problem
from kvchat.chat.store import Store
from kvchat.errors import KvchatError


def readonly_failure(monkeypatch) -> None:
    """SQLite's failure for a database it may not write. As root (CI containers) the
    permission bits are not enforced, so the failure is raised here as SQLite raises it."""
    real_connect = sqlite3.connect

    def connect(*args, **kwargs):
        db = real_connect(*args, **kwargs)
        if os.geteuid() == 0:
            db.close()
            raise sqlite3.OperationalError("attempt to write a readonly database")
        return db

    monkeypatch.setattr(store_module.sqlite3, "connect", connect)


def test_a_read_only_database_file_is_named_with_its_permissions(tmp_path, monkeypatch) -> None:
    path = tmp_path / "data" / "kvchat.sqlite3"
    Store(path).close()
    path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    readonly_failure(monkeypatch)
    with pytest.raises(KvchatError) as caught:
        Store(path)
    message = str(caught.value)
    assert "read-only" in message and str(path) in message and "-r--r--r--" in message
    assert "chmod u+w" in message and "Move the file away" not in message


def test_a_read_only_folder_is_named(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "data"
    path = folder / "kvchat.sqlite3"
    Store(path).close()
    for extra in folder.iterdir():
        if extra != path:
            extra.unlink()
    folder.chmod(0o555)
    readonly_failure(monkeypatch)
    try:
        with pytest.raises(KvchatError) as caught:
            Store(path)
    finally:
        folder.chmod(0o755)
    message = str(caught.value)
    assert f"the folder {folder} is not writable" in message and "journal" in message
    assert "Move the file away" not in message


def test_a_folder_that_cannot_be_created_is_named(tmp_path) -> None:
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        problem = access_problem(parent / "data" / "kvchat.sqlite3")
    finally:
        parent.chmod(0o755)
    assert problem is not None and f"the folder {parent} is not writable" in problem


def test_a_writable_database_has_no_access_problem(tmp_path) -> None:
    path = tmp_path / "kvchat.sqlite3"
    Store(path).close()
    assert access_problem(path) is None
