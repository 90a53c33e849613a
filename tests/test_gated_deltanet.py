"""The Gated DeltaNet layer (`kvchat.model.gated_deltanet`) against transformers' own, on
tiny random Qwen3.5 and Qwen3-Next configs: a prompt in one call, in chunks carrying the
state and then decoded a token a call, in float32 and bfloat16; and the chunked rule
against the token-by-token one."""

from __future__ import annotations

import copy

import pytest
import torch

from kvchat.model.gated_deltanet import (
    DeltaNetShape,
    DeltaNetState,
    GatedDeltaNet,
    chunk_rule,
    recurrent_rule,
)
from tests.parity_helpers import rel_err

# two key heads serving four value heads; key and value heads of different sizes, so a
# mix-up of the two shows
LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
SMALL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,  # three linear-attention layers, then a full-attention one
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    **LINEAR,
)
LAYER = 1  # not the first, so a mix-up of layer indices in the reference's cache shows


def hf_model(family: str, seed: int = 0):
    """A tiny random transformers model of `family` ("qwen3_5", "qwen3_next")."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig

    if family == "qwen3_next":
        config = Qwen3NextConfig(
            **SMALL,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        )
    else:
        config = Qwen3_5TextConfig(**SMALL)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # spread the projections, so z, b and a vary by token and head
        for name, p in model.named_parameters():
            if "linear_attn" not in name:
                continue
            if p.dim() == 2:
                p.mul_(10.0)
            elif name.endswith(("norm.weight", "dt_bias")):
                p.uniform_(0.5, 1.5)  # both start at ones
            elif name.endswith("A_log"):
                # decays of exp(-0.02) to exp(-0.5) a token (the init's reach to exp(-16)):
                # a token's write lasts across calls, so a state dropped between them shows
                p.copy_(torch.empty_like(p).uniform_(0.02, 0.5).log())
    return model


def kvchat_layer(model, dtype: torch.dtype = torch.float32) -> GatedDeltaNet:
    prefix = f"model.layers.{LAYER}."
    weights = {
        k.removeprefix(prefix): v.to(dtype)
        for k, v in model.state_dict().items()
        if k.startswith(prefix)
    }
    return GatedDeltaNet(DeltaNetShape.from_hf(model.config.to_dict()), weights)


def hf_run(model, x: torch.Tensor, pieces: list[int], dtype: torch.dtype = torch.float32):
    """transformers' layer over x [T, hidden] in calls of `pieces` tokens, its cache
    carried: (outputs [T, hidden], conv state [conv_dim, K], recurrent state)."""
    from transformers import DynamicCache

    layer = model.model.layers[LAYER].linear_attn
    if dtype != torch.float32:
        layer = copy.deepcopy(layer).to(dtype)
    cache = DynamicCache(config=model.config)
    outs, start = [], 0
    with torch.no_grad():
        for n in pieces:
            outs.append(layer(x[None, start : start + n].to(dtype), cache=cache)[0])
            start += n
    states = cache.layers[LAYER]
    return torch.cat(outs), states.conv_states[0][0], states.recurrent_states[0][0]


def kvchat_run(layer: GatedDeltaNet, x: torch.Tensor, pieces: list[int], dtype=torch.float32):
    state = layer.zero_state()
    outs, start = [], 0
    for n in pieces:
        out, state = layer.forward(x[start : start + n].to(dtype), state)
        outs.append(out)
        start += n
    return torch.cat(outs), state


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, SMALL["hidden_size"], generator=torch.Generator().manual_seed(seed))


def chunks_then_decode(prefill: int, chunk: int, total: int) -> list[int]:
    pieces = [chunk] * (prefill // chunk) + ([prefill % chunk] if prefill % chunk else [])
    return pieces + [1] * (total - prefill)


@pytest.fixture(scope="module")
def qwen3_5():
    return hf_model("qwen3_5")


@pytest.mark.parametrize("n", [40, 150], ids=["one chunk", "three chunks of 64"])
def test_a_prompt_in_one_call_matches_transformers_fp32(qwen3_5, n):
    x = prompt(n)
    expected, conv, recurrent = hf_run(qwen3_5, x, [n])
    out, state = kvchat_run(kvchat_layer(qwen3_5), x, [n])
    assert rel_err(out, expected) < 1e-5
    # transformers keeps K inputs, the oldest never read again: kvchat keeps the K - 1 read
    assert torch.allclose(state.conv, conv[:, 1:].T, rtol=1e-6, atol=1e-6)
    assert rel_err(state.recurrent, recurrent) < 1e-5


def test_chunked_prefill_then_decode_matches_one_call_fp32(qwen3_5):
    """Chunks of 7 (the last of 2, shorter than the convolution's reach) and then one
    token a call: the same outputs as the prompt in one call, and the same state as
    transformers' cache after the same calls."""
    x = prompt(40)
    pieces = chunks_then_decode(30, 7, 40)
    assert pieces[:6] == [7, 7, 7, 7, 2, 1]
    whole, _, whole_recurrent = hf_run(qwen3_5, x, [40])
    _, conv, recurrent = hf_run(qwen3_5, x, pieces)
    out, state = kvchat_run(kvchat_layer(qwen3_5), x, pieces)
    assert rel_err(out, whole) < 1e-5
    assert torch.allclose(state.conv, conv[:, 1:].T, rtol=1e-6, atol=1e-6)
    assert rel_err(state.recurrent, recurrent) < 1e-5
    assert rel_err(state.recurrent, whole_recurrent) < 1e-5


def test_bf16_is_as_close_to_fp32_as_transformers_bf16(qwen3_5):
    x = prompt(40)
    pieces = chunks_then_decode(30, 7, 40)
    reference, _, reference_recurrent = hf_run(qwen3_5, x, [40])
    hf_bf16, _, hf_recurrent = hf_run(qwen3_5, x, pieces, torch.bfloat16)
    out, state = kvchat_run(kvchat_layer(qwen3_5, torch.bfloat16), x, pieces, torch.bfloat16)
    assert out.dtype == state.conv.dtype == torch.bfloat16
    assert state.recurrent.dtype == torch.float32
    hf_error = rel_err(hf_bf16, reference)
    assert 1e-4 < hf_error < 0.05  # bf16 rounding shows, and nothing worse
    assert rel_err(out, reference) < 1.2 * hf_error
    assert rel_err(state.recurrent, reference_recurrent) < 1.2 * rel_err(
        hf_recurrent, reference_recurrent
    )
    assert rel_err(out, hf_bf16) < hf_error  # nearer transformers' bf16 than fp32 is


def test_qwen3_next_fused_projections_match_transformers_fp32():
    """Qwen3-Next's in_proj_qkvz and in_proj_ba, grouped by key head, split into
    Qwen3.5's order."""
    model = hf_model("qwen3_next")
    x = prompt(40, seed=2)
    pieces = chunks_then_decode(30, 7, 40)
    whole, _, _ = hf_run(model, x, [40])
    _, conv, recurrent = hf_run(model, x, pieces)
    out, state = kvchat_run(kvchat_layer(model), x, pieces)
    assert rel_err(out, whole) < 1e-5
    assert torch.allclose(state.conv, conv[:, 1:].T, rtol=1e-6, atol=1e-6)
    assert rel_err(state.recurrent, recurrent) < 1e-5


def test_chunked_rule_computes_the_token_by_token_recurrence():
    """From a state that is not zero, over 130 tokens (three chunks, the last padded)."""
    g = torch.Generator().manual_seed(3)
    h, t, dk, dv = 3, 130, 8, 5

    def unit(*size: int) -> torch.Tensor:
        y = torch.randn(*size, generator=g)
        return y / y.norm(dim=-1, keepdim=True)

    q, k, v = unit(h, t, dk) * dk**-0.5, unit(h, t, dk), torch.randn(h, t, dv, generator=g)
    decay = -torch.rand(h, t, generator=g) * 0.5
    beta = torch.rand(h, t, generator=g)
    state = torch.randn(h, dk, dv, generator=g)
    expected, expected_state = recurrent_rule(q, k, v, decay, beta, state)
    out, final = chunk_rule(q, k, v, decay, beta, state)
    assert rel_err(out, expected) < 1e-5
    assert rel_err(final, expected_state) < 1e-5


def test_zero_state_has_the_documented_shapes(qwen3_5):
    layer = kvchat_layer(qwen3_5)
    state = layer.zero_state()
    assert isinstance(state, DeltaNetState)
    conv_dim = 2 * 2 * 16 + 4 * 8  # q and k of two key heads, v of four value heads
    assert state.conv.shape == (3, conv_dim)
    assert state.recurrent.shape == (4, 16, 8)
    assert not state.conv.any() and not state.recurrent.any()


def test_the_states_kept_within_a_call_are_those_after_its_prefixes(qwen3_5):
    """`forward_keeping` cuts the rule where states are wanted (a page of the cache ends):
    the same outputs as one call, and each kept state the one a call over that prefix
    leaves; a prefill resumed from a kept state goes on as if never cut."""
    layer = kvchat_layer(qwen3_5)
    x = prompt(100)
    start = layer.zero_state()
    whole, final = layer.forward(x, start)
    out, last, kept = layer.forward_keeping(x, start, (1, 37, 64, 100))
    assert rel_err(out, whole) < 1e-5 and rel_err(last.recurrent, final.recurrent) < 1e-5
    assert len(kept) == 4 and kept[-1] is last
    for offset, state in zip((1, 37, 64), kept, strict=False):
        _, alone = layer.forward(x[:offset], start)
        assert torch.allclose(state.conv, alone.conv, rtol=1e-5, atol=1e-6)  # in_proj on T rows
        assert rel_err(state.recurrent, alone.recurrent) < 1e-5
    resumed, _ = layer.forward(x[37:], kept[1])
    assert rel_err(resumed, whole[37:]) < 1e-5
