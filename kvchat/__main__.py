"""`python -m kvchat` runs the same entry point as the `kvchat` command."""

from kvchat.cli import main

raise SystemExit(main())
