"""The Textual TUI: sessions, streaming transcript, input, cache meters.

What a user sees (README.md, "Using it"); how it is built: docs/tui.md.

It sits on the chat layer (`kvchat.chat`) and never imports torch: the real
engine is reached only through `kvchat.tui.backend.start_real_backend`, which
imports the runtime inside a thread worker.
"""
