"""The Textual TUI: sessions, streaming transcript, input and cache meters (DESIGN.md "What a user sees").

It sits on the chat layer (`kvchat.chat`) and never imports torch: the real
engine is reached only through `kvchat.tui.backend.start_real_backend`, which
imports the runtime inside a thread worker.
"""
