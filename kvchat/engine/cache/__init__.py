"""The page table and what only it uses: pages named by the chained hash of their tokens,
the prefix index that finds them, reference counts, free lists, eviction order and
defragmentation (docs/kv-cache.md)."""
