"""`kvchat bench`: the workloads (docs/benchmarks.md), kvchat and its peers side by side in one run.

The runner (`runner.py`) loads the model once, runs each workload for each engine
in turn (interleaved per repeat, so the machine's noise falls on all of them
alike), and writes a Markdown table, a JSON file of raw numbers and medians, and
PNG charts (`report.py`). Each workload is one module under `workloads/`, holding
both its run and its table. Each engine lives in its own file under `peers/`;
the peers' packages are the optional extra `bench`, never kvchat's dependencies.
"""
