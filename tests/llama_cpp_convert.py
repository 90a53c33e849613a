"""llama.cpp's own converter (`convert_hf_to_gguf.py`), for GGUFs of model families no
real weights of which can be fetched here: the tests write random-weight Hugging Face
folders of a family's shapes and convert them exactly as a user's GGUF was made.

The converter, its `conversion/` package and `gguf-py` come from the llama-cpp-python
sdist the llama-server build uses, fetched once into the shared test cache by the
bench's own `kvchat.bench.llama_cpp_tools`.
"""

from __future__ import annotations

from pathlib import Path

from kvchat.bench import llama_cpp_tools
from kvchat.bench.llama_cpp_tools import ConverterUnavailable
from tests.shared_cache import TEST_CACHE

__all__ = ["ConverterUnavailable", "convert", "converter", "llama_quantize", "requantize"]


def converter() -> Path:
    """The folder holding convert_hf_to_gguf.py, conversion/ and gguf-py/ (fetched once
    into the shared test cache)."""
    return llama_cpp_tools.converter(TEST_CACHE)


def convert(
    hf_folder: Path, out: Path, outtype: str = "f32", options: tuple[str, ...] = ()
) -> Path:
    """`hf_folder` as a GGUF of `outtype` (f32, bf16, q8_0), as llama.cpp converts it;
    `options`: more of the converter's flags (`--no-mtp`)."""
    return llama_cpp_tools.convert(hf_folder, out, outtype, TEST_CACHE, options)


def llama_quantize(source: Path, out: Path, qtype: str) -> Path:
    """`source` (a converter's f32 GGUF) as llama-quantize makes a `qtype` (Q4_0, Q4_K_M)
    file of it, its own choice of type for each tensor; `ConverterUnavailable` where no
    llama-server build holds llama-quantize."""
    from kvchat.errors import KvchatError

    try:
        binary = llama_cpp_tools.find_quantize()
    except KvchatError as exc:
        raise ConverterUnavailable(str(exc)) from exc
    return llama_cpp_tools.quantize(source, out, qtype, binary)


def requantize(
    source: Path,
    out: Path,
    qtype: str | None = "Q4_0",
    experts: str | None = None,
    keep: tuple[str, ...] = (),
) -> Path:
    """`source` (a converter's f32 GGUF) with its layers' matrices in `qtype` and its
    stacked experts (`*_exps.weight`) in `experts` (None: as they are), but those named
    `blk.{i}.{kept}.weight` for a `kept` in `keep`, the rest as it is:
    what `llama-quantize` makes of the layers, which the llama-server build leaves out
    (gpt-oss's files hold their experts in MXFP4). Metadata is copied field by field; the
    matrices are quantized by gguf-py's own reference code."""
    import gguf
    import numpy as np

    kind = gguf.GGMLQuantizationType[qtype] if qtype else None
    expert_kind = gguf.GGMLQuantizationType[experts] if experts else None
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        # as llama-quantize, rows of a length no block divides stay as they are (a Gated
        # DeltaNet's 4-wide convolution kernel)
        layer_matrix = (
            tensor.name.startswith("blk.")
            and data.dtype == np.float32
            and data.shape[-1] % 32 == 0
            and tensor.name.split(".")[2] not in keep
        )
        if kind is not None and layer_matrix and data.ndim == 2:
            writer.add_tensor(tensor.name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        elif expert_kind is not None and layer_matrix and tensor.name.endswith("_exps.weight"):
            quantized = gguf.quants.quantize(data, expert_kind)
            writer.add_tensor(tensor.name, quantized, raw_dtype=expert_kind)
        else:
            writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
