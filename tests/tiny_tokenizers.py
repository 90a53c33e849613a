"""Small but real tokenizers for tests: byte-level BPE written as HF folders.

Tests across kvchat need a tokenizer that behaves like a real model's (byte-level
BPE, special tokens parsed out of rendered chat text, a chat template in
`tokenizer_config.json`) without any download. `write_tiny_tokenizer` trains one
in a few milliseconds on the built-in text below; training is deterministic, so
every run and every test gets the same ids. Tests that write tiny random-weight
models use `TINY_VOCAB_SIZE` for the embedding size.

Two styles:
- "chatml": like SmolLM2 (`<|endoftext|>`=0, `<|im_start|>`=1, `<|im_end|>`=2,
  bos `<|im_start|>`, eos `<|im_end|>`, no BOS added, SmolLM2's exact template).
- "llama3": like Llama 3 Instruct (Llama-3 split regex, a post-processor that
  adds `<|begin_of_text|>`, eos `<|eot_id|>`, `<|eom_id|>` present, Meta's
  Llama 3 template).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# Every tiny tokenizer has exactly this many ids (specials included).
TINY_VOCAB_SIZE = 384

CHATML_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
LLAMA3_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
)

# SmolLM2-135M-Instruct's template, copied from its GGUF (`tokenizer.chat_template`).
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Meta's Llama 3 Instruct template (the one before 3.1 added tools and dates).
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

# Llama 3's pre-tokenizer regex (splits digits in groups of up to three).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A user asks a question and the
assistant answers it. You are a helpful assistant. Hello! How are you today?
I am fine, thank you. What is the capital of France? The capital of France is
Paris. Summarize what the code above does in one sentence. Name one function
defined in that code. What Python module does this code come from? Is there
any error handling in it? Answer briefly.

def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for index, value in enumerate(values):
    print(f"{index}: {value}")

class Session:
    def __init__(self, name):
        self.name = name
        self.messages = []

The cache keeps pages of tokens; each page is named by a hash of its tokens and
its parent. When the conversation switches, the pages that are still there are
reused and only the new tokens are computed. 1234567890 3.14159 2024-07-26
"""


def _train(
    special_tokens: tuple[str, ...], pre_tokenizer: pre_tokenizers.PreTokenizer
) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([TRAINING_TEXT] * 4, trainer=trainer)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != TINY_VOCAB_SIZE:
        raise RuntimeError(f"tiny tokenizer has {size} ids, expected {TINY_VOCAB_SIZE}")
    return tokenizer


def build_tiny_tokenizer(style: Literal["chatml", "llama3"]) -> Tokenizer:
    """Train the tiny tokenizer of `style` (deterministic) and return it."""
    if style == "chatml":
        tokenizer = _train(CHATML_SPECIAL_TOKENS, pre_tokenizers.ByteLevel(add_prefix_space=False))
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
        return tokenizer
    if style == "llama3":
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer = _train(LLAMA3_SPECIAL_TOKENS, pre_tokenizers.Sequence([split, byte_level]))
        bos = "<|begin_of_text|>"
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokenizer.token_to_id(bos))],
        )
        return tokenizer
    raise ValueError(f"unknown tiny tokenizer style {style!r}")


def write_tiny_tokenizer(folder: Path, style: Literal["chatml", "llama3"]) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` of `style` into `folder`.

    The config carries `chat_template`, `bos_token` and `eos_token` the way HF
    models do; the llama3 one has no `add_bos_token`, as Meta's, so the BOS comes
    from the post-processor.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(style)
    tokenizer.save(str(folder / "tokenizer.json"))
    if style == "chatml":
        config: dict[str, object] = {
            "tokenizer_class": "GPT2Tokenizer",
            "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>",
            "unk_token": "<|endoftext|>",
            "pad_token": "<|im_end|>",
            "add_bos_token": False,
            "chat_template": SMOLLM2_CHAT_TEMPLATE,
            "model_max_length": 8192,
        }
    else:
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "chat_template": LLAMA3_CHAT_TEMPLATE,
            "model_max_length": 8192,
        }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


# A Qwen3-like template: earlier assistant turns lose their reasoning.
STRIP_THINKING_TEMPLATE = (
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last %}"
    "{% set content = content.split('</think>')[-1] | trim %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
