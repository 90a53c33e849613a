"""One KV page as a file: the disk tier's safetensors format, its checks, and atomic writes.

A page file holds K and V for every layer (`k`, `v`, and for the int8 KV format
`k_scale`, `v_scale`), each in the host store's slot layout `[layers, page_size,
kv_heads, head_dim]` (scales without the last axis), and string metadata: the
format and KV-numerics versions, the root salt, the page's hash and its parent's,
the geometry, the dtype and KV format, the token ids, and a blake2b checksum of
the tensor bytes. `read_page` refuses a file on any mismatch (`DiskPageInvalid`
says which): a wrong page must never be served, and a page is cheap to recompute.

Files are written under a temporary name in the destination folder and renamed
into place, so a reader (this process or another kvchat sharing the folder) sees
either no file or a whole one; both files and folders are readable by the user only.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from hashlib import blake2b
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as save_bytes

from kvchat.engine.cache.page_hash import HASH_BYTES, KV_NUMERICS_VERSION, page_hash

FORMAT_NAME = "kvchat-kv-page"
FORMAT_VERSION = 1
PAGE_SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
FILE_MODE = 0o600
DIR_MODE = 0o700

WINDOW_FLAG = "window_kept"  # 1: the page holds its windowed layers' part
STATE_PARTS = ("state_conv", "state_recurrent", "state_kept")  # a hybrid model's state
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class DiskPageInvalid(ValueError):
    """A page file that must not be used (truncated, corrupt, foreign or outdated)."""


@dataclass(frozen=True)
class DiskPageFormat:
    """What every page of one engine must match: its salt, geometry, dtype and KV format."""

    salt: bytes
    page_size: int
    num_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str  # the compute dtype's name, e.g. "bfloat16"
    kv_format: str  # "native" | "int8"
    # a model whose windowed layers are kept apart: a page may lack their part (zeros in
    # the file), and a one-byte tensor says whether it has it
    window_flag: bool = False
    # a hybrid model: the linear layers' state kept at the page's end, stacked over those
    # layers (conv [n, K - 1, channels] in `dtype`, recurrent [n, Hv, Dk, Dv] float32;
    # empty ([0, ...]) and a 0 flag where the page has none)
    state_shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    @property
    def part_names(self) -> tuple[str, ...]:
        kv = ("k", "v", "k_scale", "v_scale") if self.kv_format == "int8" else ("k", "v")
        if self.window_flag:
            kv = (*kv, WINDOW_FLAG)
        return (*kv, *STATE_PARTS) if self.state_shapes is not None else kv

    def part_shape(self, name: str) -> tuple[int, ...]:
        if name in (WINDOW_FLAG, STATE_PARTS[2]):
            return (1,)
        if name in STATE_PARTS:
            assert self.state_shapes is not None
            return self.state_shapes[STATE_PARTS.index(name)]
        shape = (self.num_layers, self.page_size, self.n_kv_heads, self.head_dim)
        return shape[:-1] if name.endswith("_scale") else shape

    def part_dtype(self, name: str) -> torch.dtype:
        if name in (WINDOW_FLAG, STATE_PARTS[2]):
            return torch.uint8
        if name == STATE_PARTS[1]:
            return torch.float32
        if name == STATE_PARTS[0]:
            return _DTYPES[self.dtype]
        if self.kv_format == "int8" and not name.endswith("_scale"):
            return torch.int8
        return _DTYPES[self.dtype]

    def page_bytes(self) -> int:
        """Tensor bytes of one page (the file adds a header of a few kilobytes)."""
        total = 0
        for name in self.part_names:
            n = 1
            for d in self.part_shape(name):
                n *= d
            total += n * torch.empty((), dtype=self.part_dtype(name)).element_size()
        return total

    @property
    def geometry(self) -> str:
        shape = f"{self.num_layers},{self.page_size},{self.n_kv_heads},{self.head_dim}"
        if self.window_flag:
            shape += ",window-flag"
        if self.state_shapes is not None:
            shape += ",states-" + "-".join("x".join(map(str, s)) for s in self.state_shapes)
        return shape


def page_path(root: Path, salt: bytes, parent: bytes, h: bytes) -> Path:
    """`<root>/<salt>/<parent-hash>/<hash>.safetensors`: the path alone gives the tree."""
    return root / salt.hex() / parent.hex() / (h.hex() + PAGE_SUFFIX)


def checksum(parts: list[torch.Tensor]) -> str:
    """blake2b over the tensors' bytes, in order (hashlib releases the GIL for big buffers)."""
    h = blake2b(digest_size=16)
    for t in parts:
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def encode_page(
    fmt: DiskPageFormat,
    h: bytes,
    parent: bytes,
    tokens: tuple[int, ...],
    parts: list[torch.Tensor],
) -> bytes:
    """The file's bytes for one page; `parts` are in `fmt.part_names` order, on the CPU."""
    names = fmt.part_names
    if len(parts) != len(names):
        raise ValueError(f"a {fmt.kv_format} page has {len(names)} tensors, got {len(parts)}")
    tensors = {name: t.contiguous() for name, t in zip(names, parts, strict=True)}
    metadata = {
        **_identity(fmt, h, parent),
        "tokens": ",".join(map(str, tokens)),
        "checksum": checksum([tensors[n] for n in names]),
    }
    return save_bytes(tensors, metadata)


def write_file_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same folder, then rename.

    The temporary name carries this process's id, so a start-up sweep can tell a
    leftover of a dead process from a file another live kvchat is writing now.
    """
    path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def temp_owner_pid(name: str) -> int | None:
    """The process id in a temporary page file's name, or None if it is not one."""
    if not (name.startswith(".") and name.endswith(TEMP_SUFFIX)):
        return None
    fields = name[: -len(TEMP_SUFFIX)].split(".")
    try:
        return int(fields[-2])
    except (IndexError, ValueError):
        return None


def read_page(
    path: Path, fmt: DiskPageFormat, h: bytes, parent: bytes
) -> tuple[tuple[int, ...], list[torch.Tensor]]:
    """The tokens and tensors of page `h`, checked against `fmt` and its own checksum.

    The file is memory-mapped; the tensors returned are copies in `fmt.part_names`
    order. Raises FileNotFoundError when the file is gone (a miss, not a fault) and
    `DiskPageInvalid` naming the first mismatch otherwise.
    """
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            _check_metadata(meta, fmt, h, parent)
            keys = set(f.keys())
            if keys != set(fmt.part_names):
                raise DiskPageInvalid(f"tensors {sorted(keys)}, expected {list(fmt.part_names)}")
            parts = [f.get_tensor(name) for name in fmt.part_names]
    except (FileNotFoundError, DiskPageInvalid):
        raise
    except Exception as exc:  # safetensors reports a bad header or a short file this way
        if not path.exists():
            raise FileNotFoundError(str(path)) from None
        raise DiskPageInvalid(f"unreadable ({exc})") from None
    for name, t in zip(fmt.part_names, parts, strict=True):
        want = fmt.part_shape(name)
        none = name in STATE_PARTS[:2] and tuple(t.shape) == (0, *want[1:])  # no state kept
        if (tuple(t.shape) != want and not none) or t.dtype != fmt.part_dtype(name):
            raise DiskPageInvalid(f"tensor {name} is {tuple(t.shape)} {t.dtype}")
    if checksum(parts) != meta["checksum"]:
        raise DiskPageInvalid("checksum mismatch")
    tokens = tuple(int(x) for x in meta["tokens"].split(","))
    return tokens, parts


def _identity(fmt: DiskPageFormat, h: bytes, parent: bytes) -> dict[str, str]:
    """The metadata that names a page and its format: written into every file, and a file
    whose copy differs in any key is not served."""
    return {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "kv_numerics": str(KV_NUMERICS_VERSION),
        "salt": fmt.salt.hex(),
        "hash": h.hex(),
        "parent": parent.hex(),
        "page_size": str(fmt.page_size),
        "geometry": fmt.geometry,
        "dtype": fmt.dtype,
        "kv_format": fmt.kv_format,
    }


def _check_metadata(meta: dict[str, str], fmt: DiskPageFormat, h: bytes, parent: bytes) -> None:
    want = _identity(fmt, h, parent)
    for key, value in want.items():
        got = meta.get(key)
        if got != value:
            raise DiskPageInvalid(f"metadata {key} is {got!r}, expected {value!r}")
    try:
        tokens = [int(x) for x in meta["tokens"].split(",")]
    except (KeyError, ValueError):
        raise DiskPageInvalid("token ids missing or malformed") from None
    if len(tokens) != fmt.page_size or page_hash(parent, tokens) != h:
        raise DiskPageInvalid("token ids do not give the page's hash")
    if "checksum" not in meta:
        raise DiskPageInvalid("no checksum")


def parse_hash(text: str) -> bytes | None:
    """A page hash from its hex spelling in a file or folder name, or None if it is not one."""
    if len(text) != 2 * HASH_BYTES:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None
