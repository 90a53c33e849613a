"""The page table's mutable records: one per device page, one per live sequence.

Only the page table and its parts (prefix index, eviction, defragmentation, the
invariant checker) touch these; everyone else sees the frozen `PageInfo`.
"""

from __future__ import annotations


class Page:
    """Mutable state of one device page."""

    __slots__ = ("hash", "index", "last_used", "parent", "refcount", "tokens", "type_ahead_from")

    def __init__(self, index: int) -> None:
        self.index = index
        self.hash: bytes | None = None
        self.parent: bytes | None = None
        self.tokens: list[int] = []  # len(tokens) is the number of filled slots
        self.refcount = 0
        self.last_used = 0
        # slots from here on were computed by a type-ahead and no turn has used them yet (a guess)
        self.type_ahead_from: int | None = None


class SeqPages:
    """The pages of one live sequence, in order, and how many of its tokens are written."""

    __slots__ = ("num_tokens", "pages", "resume_state", "type_ahead", "window_from", "window_to")

    def __init__(self, pages: list[int], num_tokens: int, type_ahead: bool = False) -> None:
        self.pages = pages
        self.num_tokens = num_tokens  # tokens whose K/V is written
        self.type_ahead = type_ahead  # a type-ahead's pages: what it writes is marked as a guess
        # its pages [window_from, window_to) hold their window part for it (`window_slots`)
        self.window_from = 0
        self.window_to = 0
        # a hybrid model's: the linear layers' state it resumes from (`state_snapshots`)
        self.resume_state: object = None
