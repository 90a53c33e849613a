"""GGUFs of the families beyond Llama, made by llama.cpp's own converter from
random-weight Hugging Face folders of each family's shapes: kvchat reads the file to
the logits transformers computes from the folder.

The folders carry the default model's tokenizer (SmolLM2's byte-level BPE, which the
converter recognizes), so the converter writes a real vocabulary and chat template.
"""

from __future__ import annotations

import pytest
import torch

from kvchat.model.loader import load_model
from tests.llama_cpp_convert import ConverterUnavailable, convert
from tests.parity_helpers import kvchat_logits, rel_err

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def default_tokenizer(default_gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_gguf_path.parent, gguf_file=default_gguf_path.name)


# family -> what the file must say of it once read back
FAMILIES = {
    "qwen3": lambda c: c.qk_norm and c.head_dim == 32,  # head_dim from key_length
    "smollm3": lambda c: c.rope_layers == (True, True, True, False),  # llama.cpp's fixed 4
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_folder(request, tmp_path_factory, default_tokenizer):
    from tests.tiny_models import write_tiny_model

    folder = tmp_path_factory.mktemp(request.param)
    write_tiny_model(folder, request.param, vocab_size=len(default_tokenizer), with_tokenizer=False)
    default_tokenizer.save_pretrained(folder)
    return request.param, folder


def hf_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


@pytest.mark.parametrize(("outtype", "tolerance"), [("f32", 1e-4), ("q8_0", 0.05)])
def test_a_gguf_from_llama_cpps_converter_gives_transformers_logits(
    family_folder, tmp_path, outtype, tolerance
) -> None:
    family, folder = family_folder
    try:
        gguf = convert(folder, tmp_path / f"{family}-{outtype}.gguf", outtype)
    except ConverterUnavailable as exc:
        pytest.skip(f"llama.cpp's converter could not be fetched: {exc}")
    model = load_model(str(gguf), dtype="float32", device="cpu")
    assert model.config.model_type == family and FAMILIES[family](model.config)
    ids = torch.randint(
        0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(1)
    )
    error = rel_err(kvchat_logits(model, ids.tolist(), paged=True), hf_logits(folder, ids))
    assert error < tolerance, error
    # the file's vocabulary and template: the prompt renders as the folder's does
    folder_model = load_model(str(folder), dtype="float32", device="cpu")
    chat = [{"role": "user", "content": "What is a KV cache?"}]
    assert model.renderer.prompt_ids(chat) == folder_model.renderer.prompt_ids(chat)
