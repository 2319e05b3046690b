"""GTPO through torchtitan's own code (skipped without torchtitan; CI installs it in an environment of its
own): GTPOLoss built from its config (torchtitan's Configurable.build) and wired as the RL trainer wires a
ChunkedLossWrapper (set_lm_head, the model's `_skip_lm_head`), on hidden states of a torchtitan Llama3
model and microbatches packed by torchtitan's own Batcher. With GTPO's entropy options off it equals the
stock loss the trainer uses, ChunkedLossWrapper(GRPOLoss / DAPOLoss) (value, and the gradients of the
hidden states and of the LM head); with them on it equals gtpo_loss on the materialized logits of the
same completions. (torchtitan's RL package imports vLLM at its top: the tests import its losses and
batcher modules with that top-level import stubbed. Flex attention has no CPU backward: the model runs
forward only, and the gradient is checked on its hidden states. The model's flex attention runs eagerly:
torch 2.13's compiled CPU flex kernel, on these packed [2, 24] rows with torchtitan's packed-document
mask, reads garbage for the second row in most processes (NaN or wrong hidden states, different each
process), where eager flex equals dense attention under the same mask.)"""
from __future__ import annotations

import os
import sys
import types
import warnings
from unittest import mock

import pytest
import torch

pytest.importorskip("torchtitan.components.loss")

from gtpo_kernels import GTPOConfig, gtpo_loss  # noqa: E402
from gtpo_kernels.integrations.torchtitan import GTPOLoss  # noqa: E402
from torchtitan.components.loss import ChunkedLossWrapper  # noqa: E402


def _rl():
    """torchtitan.experiments.rl's losses, batcher and types, without its vLLM-importing __init__."""
    import torchtitan.experiments as ex
    root = os.path.join(os.path.dirname(ex.__file__), "rl")
    for name, sub in (("torchtitan.experiments.rl", ""), ("torchtitan.experiments.rl.losses", "losses"),
                      ("torchtitan.experiments.rl.components", "components")):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [os.path.join(root, sub) if sub else root]
            sys.modules[name] = mod
    from torchtitan.experiments.rl.components.batcher import Batcher
    from torchtitan.experiments.rl.losses import dapo, grpo
    from torchtitan.experiments.rl.types import RolloutTurnID, TrainingSample
    return dapo.DAPOLoss, grpo.GRPOLoss, Batcher, TrainingSample, RolloutTurnID


D, V, H, L = 32, 80, 2, 24


def _model():
    import torchtitan.models.llama3 as m
    torch.manual_seed(0)
    cfg = m.Llama3Model.Config(
        dim=D, vocab_size=V,
        tok_embeddings=m.Embedding.Config(num_embeddings=V, embedding_dim=D, param_init=m._EMBEDDING_INIT),
        norm=m.RMSNorm.Config(normalized_shape=D, param_init=m._NORM_INIT),
        lm_head=m.Linear.Config(in_features=D, out_features=V, param_init=m._output_linear_init(D)),
        layers=m._build_llama3_layers(fuse_qkv=True, n_layers=1, dim=D, n_heads=H,
                                      hidden_dim=m.compute_ffn_hidden_dim(D, multiple_of=32),
                                      rope=m.ComplexRoPE.Config(dim=D // H, max_seq_len=64, theta=10000.0,
                                                                scaling="none"),
                                      attn_backend="flex"))
    model = cfg.build()
    model.init_states()
    with torch.no_grad():  # a head whose logits spread (init_states' small std makes them nearly flat)
        model.lm_head.weight.normal_(0, 0.5)
    return model


def _microbatch(g):
    """Rows packed by torchtitan's Batcher from random single-turn samples (prompt + completion)."""
    _, _, Batcher, TrainingSample, RolloutTurnID = _rl()
    b = object.__new__(Batcher)
    b.pad_id, b._per_sample_pad_multiple, b.seq_len = 0, None, L
    rows = []
    for r in range(2):
        samples = []
        for k in range(2):
            p, c = int(torch.randint(2, 5, (1,), generator=g)), int(torch.randint(3, 7, (1,), generator=g))
            ids = torch.randint(1, V, (p + c,), generator=g).tolist()
            adv = float(torch.randn(1, generator=g))
            lp = (-torch.rand(c, generator=g) * 2).tolist()  # replaced near the model's in _hidden
            samples.append(TrainingSample(min_policy_version=0, max_policy_version=0,
                                          rollout_id=RolloutTurnID(group_id=r, rollout_id=k, turn_id=0),
                                          token_ids=ids, loss_mask=[False] * p + [True] * c,
                                          logprobs=[0.0] * p + lp, advantage=[0.0] * p + [adv] * c))
        rows.append(b._pack_training_sample_row(samples))
    return Batcher.collate(rows), rows


def _hidden(model, mb, g):
    """The model's hidden states; the generator's log-probs set near the model's (ratios near 1, some
    clipped), 0 off the completions as torchtitan pads them."""
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention
    model._skip_lm_head = True  # as the trainer sets it for a ChunkedLossWrapper loss
    # eager flex attention in place of torchtitan's torch.compile'd one (module docstring)
    with torch.no_grad(), mock.patch.object(FlexAttention, "_compiled_flex_attn", flex_attention), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        h = model(mb.token_ids, attention_masks=model.get_attention_masks(mb.positions), positions=mb.positions)
    with torch.no_grad():
        assert torch.isfinite(h).all(), "the model's hidden states are not finite"
        logp = torch.log_softmax(h @ model.lm_head.weight.T, -1).gather(-1, mb.labels[..., None])[..., 0]
        noisy = logp + 0.3 * torch.randn(logp.shape, generator=g)
        mb.generator_logprobs = torch.where(mb.loss_mask, noisy, torch.zeros_like(noisy))
    return h.detach()


def _run(loss_fn, model, h, mb, gvt):
    if isinstance(loss_fn, ChunkedLossWrapper):  # the trainer's wiring (PolicyTrainer.__init__)
        loss_fn.set_lm_head(model.lm_head)
    model.lm_head.weight.grad = None
    pred = h.clone().requires_grad_(True)
    loss, metrics = loss_fn(pred, mb.labels, gvt, generator_logprobs=mb.generator_logprobs,
                            advantages=mb.advantages, loss_mask=mb.loss_mask)
    loss.backward()
    return loss.detach(), pred.grad, model.lm_head.weight.grad.clone(), metrics


@pytest.mark.parametrize("stock,given", [("grpo", True), ("dapo", True), ("dapo", False)])
def test_equals_the_stock_chunked_loss(stock, given):
    """given=False: no global_valid_tokens, torchtitan's losses then divide by 1 (a sum); so does GTPOLoss."""
    DAPOLoss, GRPOLoss, *_ = _rl()
    g = torch.Generator().manual_seed(1 if stock == "grpo" else 2)
    model = _model()
    mb, _ = _microbatch(g)
    h = _hidden(model, mb, g)
    hi = 0.2 if stock == "grpo" else 0.28
    inner = GRPOLoss.Config(clip_eps=0.2) if stock == "grpo" else DAPOLoss.Config(ratio_clip_low=0.2,
                                                                                   ratio_clip_high=0.28)
    gvt = int(mb.loss_mask.sum()) + 3 if given else None  # the global count: other micro-batches hold tokens too
    want = _run(ChunkedLossWrapper.Config(num_chunks=2, loss_fn=inner).build(), model, h, mb, gvt)
    ours_fn = GTPOLoss.Config(eps_low=0.2, eps_high=hi, entropy_threshold=None, entropy_penalty=0.0).build()
    assert isinstance(ours_fn, GTPOLoss)
    got = _run(ours_fn, model, h, mb, gvt)
    assert want[1].abs().sum() > 0 and want[2].abs().sum() > 0
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[2], want[2], atol=1e-6, rtol=1e-5)
    assert sorted(got[3]) == sorted(want[3]), (got[3], want[3])  # the metrics torchtitan's loss logs
    for k in want[3]:
        if k != "loss/mean":  # (the chunked loss sums its chunks' means)
            torch.testing.assert_close(got[3][k].float(), want[3][k].float(), atol=1e-5, rtol=1e-5, msg=k)
    assert 0 < float(want[3]["loss/ratio_clipped_frac"]) and float(want[3]["bit_wise/logprob_diff/max"]) > 0


def test_entropy_filter_on_the_packed_completions():
    """GTPO's entropy filter and shaping (current policy's entropies) = gtpo_loss on the materialized
    logits of each sample's completion (padded form), token-mean over torchtitan's global count."""
    g = torch.Generator().manual_seed(7)
    model = _model()
    mb, rows = _microbatch(g)
    h = _hidden(model, mb, g)
    gvt = int(mb.loss_mask.sum())
    W = model.lm_head.weight.detach()
    with torch.no_grad():  # h_max between the completions' mean entropies: the filter keeps some, drops others
        p = torch.softmax(h @ W.T, -1)
        ent = -(p * p.clamp_min(1e-30).log()).sum(-1)
        sample = torch.cumsum((mb.positions == 0).long(), 1)
        hbar = sorted(float(ent[r][mb.loss_mask[r] & (sample[r] == k)].mean())
                      for r in range(ent.shape[0]) for k in sample[r][mb.loss_mask[r]].unique().tolist())
        h_max = (hbar[len(hbar) // 2 - 1] + hbar[len(hbar) // 2]) / 2
    cfg = GTPOLoss.Config(eps_low=0.2, eps_high=0.28, entropy_threshold=h_max, entropy_penalty=0.1)
    got = _run(cfg.build(), model, h, mb, gvt)
    # the same completions, one per row, from the packed rows' sample lengths
    pred = h.clone().requires_grad_(True)
    comps = []
    for r, row in enumerate(rows):
        start = 0
        for n in row["seq_lens"]:
            m = mb.loss_mask[r, start:start + n]
            comps.append((r, start + int(m.nonzero()[0]), int(m.sum())))
            start += n
    T = max(c[2] for c in comps)
    Bc = len(comps)
    logits = torch.zeros(Bc, T, V)
    ids = torch.zeros(Bc, T, dtype=torch.long)
    mask = torch.zeros(Bc, T, dtype=torch.bool)
    old = torch.zeros(Bc, T)
    adv = torch.zeros(Bc)
    for i, (r, s, n) in enumerate(comps):
        logits[i, :n] = pred[r, s:s + n] @ W.T
        ids[i, :n], mask[i, :n] = mb.labels[r, s:s + n], True
        old[i, :n], adv[i] = mb.generator_logprobs[r, s:s + n], mb.advantages[r, s]
    gc = GTPOConfig.preset("grpo", eps_high=0.28, entropy_threshold=h_max, entropy_penalty=0.1,
                           loss_agg="token-mean")
    out = gtpo_loss(logits, ids, adv, mask, old_logps=old, config=gc, num_items_in_batch=gvt, backend="reference")
    out.loss.backward()
    assert hbar[0] < h_max < hbar[-1]
    torch.testing.assert_close(got[0], out.loss.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], pred.grad, atol=1e-6, rtol=1e-5)


def test_per_token_advantages_are_refused():
    g = torch.Generator().manual_seed(3)
    model = _model()
    mb, _ = _microbatch(g)
    h = _hidden(model, mb, g)
    mb.advantages = mb.advantages + 0.01 * torch.randn(mb.advantages.shape, generator=g) * mb.loss_mask
    with pytest.raises(ValueError, match="one value per sample"):
        _run(GTPOLoss.Config().build(), model, h, mb, 10)
