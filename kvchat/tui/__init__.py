"""The Textual TUI: sessions, streaming transcript, input, cache meters.

What DESIGN.md's "What a user sees" describes.

It sits on the chat layer (`kvchat.chat`) and never imports torch: the real
engine is reached only through `kvchat.tui.backend.start_real_backend`, which
imports the runtime inside a thread worker.
"""
