"""The real default model on an AVX2-class CPU, emulated on whatever this one is: the
kernels compiled for x86-64-v3, oneDNN capped at AVX2 (so it reports no native bf16
and kvchat picks float32), ATen's kernels and MKL's at AVX2. Greedy text equals transformers'
under the same CPU in every `--weights` mode, and the start-up line names the kernels.

The settings must be in the environment before torch loads, so each check runs in a
process of its own. The emulated build is cached beside the native one in the shared
test cache: CI compiles it once per machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat.native import build as native_build

ROOT = Path(__file__).resolve().parents[1]
EMULATED_AVX2 = {
    native_build.ARCH_ENV: "x86-64-v3",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # torch's float32 matrix products: MKL's own dispatch
}

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(
        "avx2" not in native_build.cpu_flags() or native_build._compiler() is None,
        reason="needs an x86-64 CPU with AVX2 and a C++ compiler",
    ),
]


@pytest.fixture
def emulated_env(kvchat_home) -> dict[str, str]:
    """The test's own kvchat folder (its kernel cache is the run's shared one)."""
    env = {**os.environ, **EMULATED_AVX2, "PYTHONPATH": str(ROOT)}
    env.pop("KVCHAT_NATIVE_KERNELS", None)
    return env


GREEDY_CHECK = """
import json, sys, torch
from transformers import AutoModelForCausalLM
from kvchat.model.device import resolve_dtype
from kvchat.model.loader import load_model
from kvchat.native import build
from tests.engine_helpers import generate

gguf = sys.argv[1]
build.request(wait=True)
prompt = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
hf = AutoModelForCausalLM.from_pretrained(
    gguf.rsplit("/", 1)[0], gguf_file=gguf.rsplit("/", 1)[1], dtype=torch.float32
).eval()
result = {
    "loaded": build.loaded(),
    "detail": build.status().detail,
    "isa": torch.ops.kvchat.quantized_matmul_isa() if build.loaded() else None,
    "dtype": str(resolve_dtype(None, torch.device("cpu"))),
    "same": {},
}
reference = None
for weights in ("native", "bf16", "dense"):
    model = load_model(gguf, dtype="float32", device="cpu", weights=weights)
    ids = model.renderer.prompt_ids(prompt)
    if reference is None:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=48, min_new_tokens=48, do_sample=False
            )
        reference = out[0, len(ids):].tolist()
    ours = generate(model, ids, max_tokens=48, ignore_eos=True)
    result["same"][weights] = ours == reference
print(json.dumps(result))
"""


def test_greedy_float32_text_equals_transformers_on_an_avx2_cpu(
    emulated_env, default_gguf_path
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", GREEDY_CHECK, str(default_gguf_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env=emulated_env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["loaded"], result["detail"]
    assert result["isa"] == "avx2"  # x86-64-v3: AVX2 + FMA, no AVX-512
    assert result["dtype"] == "torch.float32"  # no native bf16 on this CPU
    assert result["same"] == {"native": True, "bf16": True, "dense": True}


def test_the_start_up_line_names_the_avx2_kernels(emulated_env, default_gguf_path) -> None:
    warm = subprocess.run(  # the kernels built (or found) first, as a second start finds them
        [sys.executable, "-c", "from kvchat.native import build; build.request(wait=True)"],
        env=emulated_env,
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert warm.returncode == 0, warm.stderr[-2000:]
    done = subprocess.run(
        [sys.executable, "-m", "kvchat", "ask", "--max-tokens", "4", "Hi"],
        capture_output=True,
        text=True,
        timeout=600,
        env=emulated_env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stderr.splitlines() if "attention:" in line)
    assert "kvchat's CPU kernels (avx2)" in line, line
    assert "(float32 on cpu)" in done.stderr, done.stderr[-2000:]  # no native bf16 here


def test_the_kernels_pass_their_correctness_tests_built_for_avx2(emulated_env) -> None:
    """The attention and quantized-product checks against float64 references, run again
    with the library compiled for x86-64-v3: its AVX2 paths (two 8-float vectors for the
    attention's 16, the 4-bit and 8-bit loops) are not the ones the native build runs."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "tests/test_native_attention.py",
            "tests/test_paged_attention_split.py",
            "tests/test_quantized_matmul.py",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=emulated_env,  # test_the_kernel_reports_its_vector_path: avx2 there
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout.splitlines()[-1], done.stdout[-500:]
