"""The page table's invariant checker: every rule its bookkeeping must keep, as sentences.

`PageTable.validate()` runs it; the randomized tests call that after every
operation, so a bookkeeping bug shows up as the first rule it broke rather than
as wrong text many turns later.
"""

from __future__ import annotations

from kvchat.engine.cache.cache_counters import CacheCounters
from kvchat.engine.cache.page_hash import page_hash
from kvchat.engine.cache.page_records import Page, SeqPages
from kvchat.engine.cache.prefix_index import PrefixIndex
from kvchat.engine.tiers.host_tier import HostTier


class PageTableCorrupt(AssertionError):
    """`validate()` found a broken invariant: a bug in the table, never a user error."""


def page_table_problems(
    *,
    page_size: int,
    salt: bytes,
    clock: int,
    pages: list[Page],
    free_list: list[int],
    cached: set[int],
    index: PrefixIndex,
    seqs: dict[int, SeqPages],
    host: HostTier | None,
    counters: CacheCounters,
) -> list[str]:
    """Every broken invariant, one sentence each (empty when the table is sound)."""
    out: list[str] = []
    ps = page_size
    free = set(free_list)
    if len(free) != len(free_list):
        out.append("a page is on the free list twice")
    refs: dict[int, int] = {}
    for sid, seq in seqs.items():
        if len(set(seq.pages)) != len(seq.pages):
            out.append(f"sequence {sid} holds a page twice: {seq.pages}")
        if not 0 <= seq.num_tokens <= len(seq.pages) * ps:
            out.append(f"sequence {sid}: {seq.num_tokens} tokens in {len(seq.pages)} pages")
        for i, p in enumerate(seq.pages):
            refs[p] = refs.get(p, 0) + 1
            page = pages[p]
            want = min(ps, max(0, seq.num_tokens - i * ps))
            if len(page.tokens) != want:
                out.append(
                    f"sequence {sid} page #{i} (device {p}) holds {len(page.tokens)} "
                    f"tokens, expected {want}"
                )
            if page.tokens:
                parent = salt if i == 0 else pages[seq.pages[i - 1]].hash
                if page.parent != parent:
                    out.append(f"sequence {sid} page #{i} (device {p}) has a wrong parent")
    for p, page in enumerate(pages):
        if page.index != p:
            out.append(f"page record {p} says it is page {page.index}")
        states = [p in free, page.refcount > 0, p in cached]
        if sum(states) != 1:
            out.append(
                f"page {p} is in {sum(states)} of free/referenced/cached "
                f"(free={states[0]}, refcount={page.refcount}, cached={states[2]})"
            )
        if page.refcount != refs.get(p, 0):
            out.append(f"page {p}: refcount {page.refcount} but {refs.get(p, 0)} holders")
        if page.last_used > clock:
            out.append(f"page {p}: last_used {page.last_used} is after the clock")
        if p in free and (page.tokens or page.hash is not None or page.parent is not None):
            out.append(f"free page {p} still has content")
        guess_from = page.type_ahead_from
        if guess_from is not None and not 0 <= guess_from < max(1, len(page.tokens)):
            out.append(f"page {p}: type_ahead_from {guess_from} is outside its tokens")
        if p in cached and not page.tokens:
            out.append(f"cached page {p} holds no tokens")
        if not page.tokens:
            if page.hash is not None or page.parent is not None:
                out.append(f"empty page {p} has a hash or parent")
            continue
        if len(page.tokens) > ps:
            out.append(f"page {p} holds {len(page.tokens)} tokens > page size")
        if page.parent is None:
            out.append(f"page {p} has tokens but no parent")
        elif p not in index.children.get(page.parent, ()):
            out.append(f"page {p} is missing from its parent's children")
        if len(page.tokens) == ps:
            h = page.hash
            if h is None or (index.by_hash.get(h) != p and p not in index.dups.get(h, ())):
                out.append(f"full page {p} is neither indexed nor a listed duplicate")
            if page.hash is None or page.parent is None:
                out.append(f"full page {p} has no hash")
            elif page_hash(page.parent, page.tokens) != page.hash:
                out.append(f"full page {p}: stored hash differs from the hash of its tokens")
            if p in cached and index.by_hash.get(page.hash or b"") != p:
                out.append(f"cached full page {p} is not indexed")
        elif page.hash is not None:
            out.append(f"partial page {p} has a hash")
    for h, p in index.by_hash.items():
        page = pages[p]
        if page.hash != h or len(page.tokens) != ps:
            out.append(f"index entry for page {p} names a page that is not that full page")
    for h, dups in index.dups.items():
        if not dups:
            out.append("an empty duplicate set was left behind")
        if h not in index.by_hash:
            out.append("a page computed twice has no indexed copy")
        for p in dups:
            page = pages[p]
            if page.hash != h or page.refcount == 0 or index.by_hash.get(h) == p:
                out.append(f"page {p} is listed as a live duplicate but is not one")
    for parent, kids in index.children.items():
        if not kids:
            out.append("an empty children set was left behind")
        for p in kids:
            if pages[p].parent != parent or not pages[p].tokens:
                out.append(f"page {p} is listed under a parent it does not have")
    if host is not None:
        out.extend(host.problems(ps))
    c = counters
    values = [*vars(c).values(), *vars(c.cached_tokens).values(), *vars(c.evictions).values()]
    if any(isinstance(v, int) and v < 0 for v in values):
        out.append(f"a counter is negative: {c}")
    if c.prompt_tokens != c.cached_tokens.total + c.prefilled_tokens:
        out.append(f"prompt tokens != cached + prefilled: {c}")
    return out
