"""Hugging Face transformers, loaded once and shared by the two transformers chat peers.

The same weights kvchat runs, at the same dtype: a Hugging Face folder as is, the
default model straight from its GGUF (`from_pretrained(folder, gguf_file=...)`,
which needs the `gguf` and `accelerate` packages). A GGUF whose architecture
transformers' own GGUF loader misreads (`FROM_KVCHAT_FOLDER`) is read from the folder
kvchat converted it to, the weights kvchat-dense runs, through a view of that folder
transformers can open (`transformers_view`). Generation is greedy with
end-of-sequence suppressed (`min_new_tokens`), and the first token is timed by
a streamer hook, which `generate` calls once with the prompt and then once per
new token. This file also measures transformers' speed (prefill of the last
token's logits, batch-1 decode) and its batched `generate` for W2.
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvchat.bench.peers.base import BatchResult, PeerUnavailable, SpeedMeasured
from kvchat.model.device import dtype_name

INSTALL_HINT = "install the bench extra: pip install 'kvchat[bench]'"
# GGUF architectures transformers' GGUF loader reads wrongly: its qwen3moe config takes
# neither the experts' width (`expert_feed_forward_length`) nor llama.cpp's renormalized
# routing, so it builds experts of its default width (768) that route unnormalized
FROM_KVCHAT_FOLDER = ("qwen3moe",)
VIEW_NAME = "transformers"  # the view's folder, inside kvchat's converted folder


class FirstTokenClock:
    """A `generate` streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # call 1 is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class HfModel(SpeedMeasured):
    """transformers' model and tokenizer for the kvchat model's weights."""

    name = "transformers"

    def __init__(self, kvchat_model, progress=lambda _m: None) -> None:
        try:
            import transformers
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as exc:
            raise PeerUnavailable(f"transformers is not installed ({INSTALL_HINT})") from exc
        transformers.logging.set_verbosity_error()
        self.kvchat_model = kvchat_model
        self.dtype = kvchat_model.transformer.dtype
        self.device = kvchat_model.transformer.device
        source = Path(kvchat_model.source)
        kw: dict[str, object] = {}
        folder = source
        if source.is_file() and _gguf_architecture(source) in FROM_KVCHAT_FOLDER:
            try:
                folder = transformers_view(Path(kvchat_model.folder), self.dtype)
            except OSError as exc:
                raise PeerUnavailable(f"no folder for transformers beside {source}: {exc}") from exc
        elif source.is_file():  # a GGUF: transformers dequantizes it itself
            folder, kw = source.parent, {"gguf_file": source.name}
        progress(f"Loading transformers ({dtype_name(self.dtype)}) from {source.name}...")
        try:
            self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=self.dtype, **kw)
            self.tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
        except ImportError as exc:
            raise PeerUnavailable(
                f"transformers needs more packages: {exc} ({INSTALL_HINT})"
            ) from exc
        except (OSError, ValueError) as exc:
            raise PeerUnavailable(f"transformers could not load {source}: {exc}") from exc
        self.model = self.model.to(self.device).eval()
        self.version = transformers.__version__
        tok = kvchat_model.tokenizer
        self.pad_id = next(
            (i for i in (self.tokenizer.pad_token_id, tok.eos_token_id) if i is not None), 0
        )
        self.description = f"transformers {self.version}, {dtype_name(self.dtype)}"

    # ---- prompts -------------------------------------------------------------------------

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The whole conversation through transformers' chat template and tokenizer."""
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        else:  # a GGUF whose template transformers did not carry over: the model's own
            text = self.kvchat_model.renderer.template.render(messages, add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        tok = self.kvchat_model.tokenizer
        bos = tok.bos_token_id
        if tok.add_bos_token and bos is not None and not text.startswith(tok.bos_token or "\0"):
            ids = [bos, *ids]
        return list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # ---- generation ----------------------------------------------------------------------

    def generate(
        self, ids: Sequence[int], max_new_tokens: int, cache=None
    ) -> tuple[float, list[int]]:
        """Greedy `max_new_tokens` after `ids`; (time of the first token, generated ids)."""
        clock = FirstTokenClock()
        input_ids = torch.tensor([list(ids)], device=self.device)
        kw = {"past_key_values": cache} if cache is not None else {}
        with torch.inference_mode(), warnings.catch_warnings():
            # transformers 5 renames `past_key_values` to `cache`; 4.x knows only the former
            warnings.simplefilter("ignore", FutureWarning)
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                **self._greedy(max_new_tokens, clock),
                **kw,
            )
        _sync(self.device)
        first = clock.first if clock.first is not None else time.perf_counter()
        return first, out[0, len(ids) :].tolist()

    def _greedy(self, tokens: int, clock: FirstTokenClock) -> dict[str, Any]:
        """`generate` arguments for exactly `tokens` greedy tokens, the first timed by `clock`."""
        return {
            "max_new_tokens": tokens,
            "min_new_tokens": tokens,
            "do_sample": False,
            "temperature": None,
            "top_p": None,
            "top_k": None,
            "streamer": clock,
            "pad_token_id": self.pad_id,
        }

    def _decode_span(self, ids: Sequence[int], tokens: int) -> tuple[float, float, int]:
        start_first, _ = self.generate(ids, tokens)
        return start_first, time.perf_counter(), tokens

    def _prefill_seconds(self, ids: Sequence[int]) -> float:
        input_ids = torch.tensor([list(ids)], device=self.device)
        with torch.inference_mode():
            _sync(self.device)
            start = time.perf_counter()
            self.model(input_ids, logits_to_keep=1)
            _sync(self.device)
        return time.perf_counter() - start

    def batch(self, prompts: Sequence[Sequence[int]], tokens_each: int) -> BatchResult:
        """One batched `generate`, prompts left-padded as transformers wants for decoding."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt))
            mask[row, width - len(prompt) :] = 1
        clock = FirstTokenClock()
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                ids.to(self.device),
                attention_mask=mask.to(self.device),
                **self._greedy(tokens_each, clock),
            )
        _sync(self.device)
        end = time.perf_counter()
        first = clock.first if clock.first is not None else start
        after = len(prompts) * (tokens_each - 1)
        rate = after / (end - first) if end > first else 0.0
        return BatchResult(len(prompts), tokens_each, rate, end - start)

    def close(self) -> None:
        self.model = None


def transformers_view(converted: Path, dtype: torch.dtype) -> Path:
    """A folder transformers opens as a model of kvchat's converted GGUF `converted`:
    its config and tokenizer, and its weights of `dtype` linked as `model.safetensors`
    (kvchat names them by dtype, which transformers does not look for), so no second copy
    of the weights is written. The tokenizer is declared a plain fast tokenizer: by the
    model type transformers reads a qwen3_moe folder's as `Qwen2Tokenizer`, which puts
    Qwen's pre-tokenizer in place of the file's and splits some text differently (runs
    of spaces before digits)."""
    weights = converted / f"model-{dtype_name(dtype)}.safetensors"
    if not weights.exists():
        raise PeerUnavailable(f"kvchat's converted folder {converted} has no {weights.name}")
    view = converted / VIEW_NAME
    view.mkdir(exist_ok=True)
    shutil.copyfile(converted / "config.json", view / "config.json")
    shutil.copyfile(converted / "tokenizer.json", view / "tokenizer.json")
    tokenizer_config = json.loads((converted / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (view / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    link = view / "model.safetensors"
    link.unlink(missing_ok=True)
    link.symlink_to(Path("..") / weights.name)
    return view


def _gguf_architecture(path: Path) -> str | None:
    from kvchat.model.gguf.file import GGUFFile

    with GGUFFile.open(path) as gguf:
        return gguf.architecture


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
