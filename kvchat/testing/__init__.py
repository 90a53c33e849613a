"""Test doubles for kvchat's own tests and benchmarks; nothing in the application imports them.

`fake_engine` is a scripted engine and a character-level chat template that stand
in for the model; `tui` drives the app over them with Textual's pilot; `servers_dir`
names the servers cache, where the serving engines the remote tests, the benchmarks
and CI share are built.
"""
