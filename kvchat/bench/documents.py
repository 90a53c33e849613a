"""The texts the workloads send: real source code from the installed Python's stdlib.

W1 (docs/benchmarks.md) opens each session with a standard-library module cut to its first
N tokens, in a Python code fence, and a question; the follow-ups are fixed.
Reading the files from the running interpreter keeps the bench self-contained
(no download) and the same on every machine with the same Python. Documents are
cut by kvchat's tokenizer; the peers tokenize the resulting text their own way,
which differs by a few tokens at most.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from kvchat.errors import KvchatError

W1_FILES = ("inspect.py", "typing.py", "argparse.py", "dataclasses.py")
SUMMARY_QUESTION = "Summarize what the code above does in one sentence."
FOLLOW_UPS = (
    "Name one function defined in that code.",
    "What Python module does this code come from?",
    "Is there any error handling in it? Answer briefly.",
)
# W6's sixteen conversations, each on its own module (no shared prefixes).
W6_FILES = (
    *W1_FILES,
    "subprocess.py",
    "threading.py",
    "logging/__init__.py",
    "tarfile.py",
    "pickle.py",
    "difflib.py",
    "functools.py",
    "shutil.py",
    "pydoc.py",
    "doctest.py",
    "unittest/case.py",
    "configparser.py",
)
# The sweep's two conversations (A, then B to switch away, then back to A).
SWEEP_FILES = ("collections/__init__.py", "enum.py")
W3_INGEST_FILE = "argparse.py"
W2_QUESTIONS = (
    "Write a short poem about the sea.",
    "Explain how a hash table works.",
    "What is the capital of France, and why is it famous?",
    "Give three tips for learning to cook.",
    "Describe the water cycle in simple words.",
    "Why do cats purr?",
    "List some uses of the Python language.",
    "Tell a short story about a robot who learns to paint.",
)
W3_QUESTIONS = (
    "Tell me a long story about a lighthouse keeper.",
    "Explain the history of the printing press in detail.",
    "Describe, step by step, how to bake bread at home.",
)


def stdlib_text(name: str) -> str:
    """The source of a standard-library module of the running Python."""
    path = Path(sysconfig.get_paths()["stdlib"]) / name
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KvchatError(
            f"The bench reads {path} from this Python's standard library but could not "
            f"({exc}); run it with a full CPython installation."
        ) from exc


def first_tokens(text: str, tokenizer, n: int) -> str:
    """`text` cut to its first `n` tokens (kvchat's tokenizer, as plain text)."""
    ids = tokenizer.encode(text, special=False)
    return text if len(ids) <= n else tokenizer.decode(ids[:n])


def fenced(code: str, question: str) -> str:
    return f"```python\n{code}\n```\n\n{question}"


def w1_openers(tokenizer, doc_tokens: int, files: tuple[str, ...] = W1_FILES) -> list[str]:
    """First messages: each module's first `doc_tokens` tokens and the question (W1's four
    modules unless `files` names others)."""
    return [
        fenced(first_tokens(stdlib_text(f), tokenizer, doc_tokens), SUMMARY_QUESTION) for f in files
    ]


def history_of(model, text_file: str, length: int) -> str:
    """A first message whose whole rendered prompt is about `length` tokens."""
    empty = [{"role": "user", "content": fenced("", SUMMARY_QUESTION)}]
    overhead = len(model.renderer.prompt_ids(empty))
    code = first_tokens(stdlib_text(text_file), model.tokenizer, max(16, length - overhead))
    return fenced(code, SUMMARY_QUESTION)


def user_prompt_ids(model, text: str) -> list[int]:
    """A one-message conversation as kvchat renders it (W2, W3 and the speed prompts)."""
    return model.renderer.prompt_ids([{"role": "user", "content": text}])


def code_ids(model, n: int) -> list[int]:
    """`n` token ids of real code (the speed benchmark's prompt), repeated if short."""
    ids: list[int] = []
    for name in (*W1_FILES, *SWEEP_FILES):
        ids.extend(model.tokenizer.encode(stdlib_text(name), special=False))
        if len(ids) >= n:
            break
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]
