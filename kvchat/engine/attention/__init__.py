"""Attention over the paged KV cache: kvchat's CPU kernels, SDPA and flex attention
paths, the shapes each handles, and the choice among them for a device."""
