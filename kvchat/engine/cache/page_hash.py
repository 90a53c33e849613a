"""Content names for KV pages: a chained, salted blake2b hash over token ids.

A full page is named by the hash of (its parent page's hash, its own token ids), so
one hash names a whole prefix: two sequences whose first N pages hash alike hold the
same K/V for those N pages and can share them. The chain starts at a root salt
derived from the model, dtype and KV format, so pages computed by another model,
another precision or another cache format can never be mistaken for these ones
(they would hold different numbers for the same tokens).

Pure Python (no torch): the page table and host tier use it for bookkeeping only.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b

HASH_BYTES = 16  # 128 bits: collisions are out of reach for any cache size we can hold

# Bumped whenever the forward pass or the KV layout changes the numbers a page holds: it
# is folded into every root salt (and written into every disk page), so pages computed
# by an older kvchat are never served after an upgrade that changes them.
KV_NUMERICS_VERSION = 1

_ROOT_PERSON = b"kvchat-root"  # blake2b personalization: root salts live in their own domain
_PAGE_PERSON = b"kvchat-page"
# The array typecode that is 4 bytes wide here ("I" on every platform CPython supports).
_UINT32 = "I" if array("I").itemsize == 4 else "L"


def root_salt(model_fingerprint: str, dtype: str, kv_format: str) -> bytes:
    """The parent hash of every first page, for one (model, dtype, KV format).

    The KV-numerics version is folded in too. The fields are length-prefixed so that
    no two different triples can encode to the same bytes ("ab" + "c" versus "a" + "bc").
    """
    h = blake2b(digest_size=HASH_BYTES, person=_ROOT_PERSON)
    for field in (model_fingerprint, dtype, kv_format, str(KV_NUMERICS_VERSION)):
        data = field.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def page_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a page: blake2b over the parent hash and the tokens as little-endian uint32.

    `array` packs the whole page in one C call (a 256-token page hashes in a
    couple of microseconds); it is byte-swapped on big-endian hosts so the hash of
    a page is the same on every machine (a later disk tier relies on that).
    """
    packed = array(_UINT32, token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    h = blake2b(digest_size=HASH_BYTES, person=_PAGE_PERSON)
    h.update(parent)
    h.update(packed.tobytes())
    return h.digest()
