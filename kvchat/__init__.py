"""kvchat: a terminal chat app for local LLMs built on a paged, prefix-hashed KV cache."""

__version__ = "0.1.0"
