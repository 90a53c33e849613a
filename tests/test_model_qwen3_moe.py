"""Qwen3-MoE beyond the parity tests every family has (tests/test_model_parity.py): a
step's tokens from several sequences share experts and each sequence's logits are what
it gets alone; the router without renormalization; every layer sparse; and the
router, as `SparseMoE` groups tokens by expert, against a token-by-token sum."""

from __future__ import annotations

import pytest
import torch

from kvchat.model.batch import ForwardBatch, NoCacheAttention
from kvchat.model.loader import load_model
from kvchat.model.sparse_moe import SparseMoE
from tests.parity_helpers import kvchat_logits, rel_err
from tests.tiny_models import write_tiny_model


def hf_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_batch_of_sequences_gives_each_its_logits_alone(tmp_path):
    folder = write_tiny_model(tmp_path / "moe", "qwen3_moe")
    model = load_model(str(folder), dtype="float32", device="cpu")
    runs = [random_ids(n, seed) for n, seed in ((30, 1), (7, 2), (19, 3))]
    batch = ForwardBatch.from_runs(runs, [0] * len(runs), all_logits=True)
    together = model.transformer.forward(batch, NoCacheAttention(batch))
    start = 0
    for ids in runs:
        alone = kvchat_logits(model, ids, paged=False)
        assert rel_err(together[start : start + len(ids)], alone) < 1e-5
        start += len(ids)


@pytest.mark.parametrize(
    "routing",
    [{"norm_topk_prob": False}, {"mlp_only_layers": []}],
    ids=["weights not renormalized", "every layer sparse"],
)
def test_routing_variants_match_transformers_fp32(tmp_path, routing):
    folder = write_tiny_model(tmp_path / "moe", "qwen3_moe", **routing)
    model = load_model(str(folder), dtype="float32", device="cpu")
    sparse = [layer.experts is not None for layer in model.transformer.layers]
    assert sparse == ([True] * 3 if routing.get("mlp_only_layers") == [] else [False, True, True])
    ids = torch.tensor(random_ids(64, seed=5))
    assert rel_err(kvchat_logits(model, ids.tolist(), paged=True), hf_logits(folder, ids)) < 1e-4


def test_grouping_by_expert_sums_what_each_token_would_alone():
    torch.manual_seed(0)
    experts, hidden, inner, k = 6, 16, 8, 2
    moe = SparseMoE(
        torch.randn(experts, hidden),
        torch.randn(experts, 2 * inner, hidden),
        torch.randn(experts, hidden, inner),
        experts_per_token=k,
        normalize=True,
    )
    x = torch.randn(11, hidden)
    expected = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ moe.router.T, dim=-1)
        weights, chosen = torch.topk(probs, k)
        for w, e in zip(weights / weights.sum(), chosen.tolist(), strict=True):
            gate, up = (moe.gate_up[e] @ x[t]).chunk(2)
            expected[t] += w * (moe.down[e] @ (torch.nn.functional.silu(gate) * up))
    assert torch.allclose(moe(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("mode", "kind", "tolerance"), [("int8", "Int8", 0.05), ("int4", "Q4", 0.3)]
)
def test_quantizing_the_folder_leaves_the_experts_in_the_compute_dtype(
    tmp_path, mode, kind, tolerance
):
    """`--quantize` quantizes attention and the dense layers' MLP; the experts, stacked
    per layer, are not `Linear`s and stay as they are. (4-bit rounding of these random
    weights, scaled up, moves the logits about 0.2.)"""
    folder = write_tiny_model(tmp_path / "moe", "qwen3_moe")
    model = load_model(str(folder), dtype="float32", device="cpu", quantize=mode)
    dense_layer, sparse_layer = model.transformer.layers[:2]
    assert kind in type(sparse_layer.qkv).__name__ and kind in type(dense_layer.gate_up).__name__
    assert sparse_layer.experts.gate_up.dtype == torch.float32
    ids = torch.tensor(random_ids(32, seed=6))
    error = rel_err(kvchat_logits(model, ids.tolist(), paged=True), hf_logits(folder, ids))
    assert error < tolerance, error
