"""One pass in the call (spec 8): the kernel launches, host reads and host-to-device copies of a forward +
backward, counted on the CPU as a GPU would make them (bench/launches.py: Triton launches plus the aten
ops that launch a device kernel; autograd's seed of a scalar loss, `ones_like`, included).

On the Triton backend (run by Triton's interpreter here), with validate=False: gtpo_loss on logits at most
4 launches for GTPO and the TRL-family presets (the forward vocabulary kernel, the epilogue, the seed, the
backward vocabulary kernel), padded and packed, conflict weights given (one launch more computed in the
call); token_logprobs 1, validating or not; no host read
and no tensor made from host data; validate=True exactly one host read. Every count is the same at two
batch sizes (it grows with neither tokens nor completions).
"""
import os

import pytest
import torch

from bench.launches import batch, counting
from gtpo_kernels import GTPOConfig, gtpo_loss, token_logprobs

# the presets of the three-launch path (pipeline/epilogue.py)
FAST = ["gtpo", "gtpo-official", "grpo", "dapo", "dr-grpo", "bnpo", "gspo", "luspo", "vanilla"]
SIZES = ((4, 3), (8, 4))  # (B, T): completions (groups of 4) and tokens per completion (12 and 32 tokens)


_batch = batch


def _config(preset):
    """The preset as the counts run it: grpo and dapo with a KL term and no entropy filter (a config as given)."""
    if isinstance(preset, GTPOConfig):
        return preset
    return GTPOConfig.preset(preset, beta=0.04, entropy_threshold=None) if preset in ("grpo", "dapo") \
        else GTPOConfig.preset(preset)


def _counts(prepare, packed, sizes=SIZES):
    """[(launches, host reads, tensors from host data, {Triton kernel: launches})] of one call per size:
    prepare(k, B, T, logits, ids, adv, mask, kw) makes the call's inputs outside the count from _batch's and
    returns (call, leaf); call() runs the forward, whose loss is then backpropagated inside the count. The
    loss must be finite and the leaf's gradient not all zero."""
    counts = []
    for k, (B, T) in enumerate(sizes):
        call, leaf = prepare(k, B, T, *_batch(B, T, k, packed))
        with counting() as c:
            out = call()
            out.loss.backward()
        assert torch.isfinite(out.loss) and leaf.grad.abs().sum() > 0
        counts.append((c.launches, c.host_reads, c.creations, dict(c.triton_names)))
    return counts


def _logps_of(logits, ids):
    """(differentiable log-probs of ids, entropies) from logits, made before a count."""
    logp_all = torch.log_softmax(logits, -1)
    return logp_all.gather(-1, ids[..., None])[..., 0].requires_grad_(), -(logp_all.exp() * logp_all).sum(-1)


def _loss_counts(preset, packed, validate, sizes=SIZES, **extra):
    def prepare(k, B, T, logits, ids, adv, mask, kw):
        x = logits.requires_grad_()
        return lambda: gtpo_loss(x, ids, adv, mask, config=_config(preset), validate=validate, backend="triton",
                                 **kw, **extra), x
    return _counts(prepare, packed, sizes)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("preset", FAST)
def test_loss_launches_at_most_four(preset, packed):
    counts = _loss_counts(preset, packed, validate=False)
    assert counts[0] == counts[1], counts  # flat in tokens and completions
    launches, reads, creations, kernels = counts[0]
    assert reads == 0 and creations == 0, counts
    assert launches <= 4, counts
    assert kernels == {"_vocab_fwd_kernel": 1, "_epilogue_kernel": 1, "_vocab_bwd_kernel": 1}


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_validating_reads_the_host_once(packed):
    counts = _loss_counts("gtpo", packed, validate=True)
    assert counts[0] == counts[1], counts
    assert counts[0][1] == 1, counts  # the status word: the input checks are in the kernel
    assert counts[0][0] <= 4, counts  # the same 4 launches as without validation


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_conflict_weights_computed_in_the_call_take_one_kernel(packed):
    """group_size instead of lam / n_conf: the conflict weights are one more launch (spec 8), from the
    call's tensors as given (no derived batch field formed), flat in tokens."""
    def prepare(k, B, T, logits, ids, adv, mask, kw):
        kw = {key: v for key, v in kw.items() if key not in ("lam", "n_conf")}
        x = logits.requires_grad_()
        return lambda: gtpo_loss(x, ids, adv, mask, group_size=2, config="gtpo", validate=False, backend="triton",
                                 **kw), x
    counts = _counts(prepare, packed)
    assert counts[0] == counts[1], counts
    launches, reads, creations, kernels = counts[0]
    assert reads == 0 and creations == 0 and launches <= 5, counts
    assert kernels == {"_conflict_weights_kernel": 1, "_vocab_fwd_kernel": 1, "_epilogue_kernel": 1,
                       "_vocab_bwd_kernel": 1}, kernels


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_tensor_hyper_parameters_stay_on_the_path(packed):
    """Hyper-parameters as 0-d tensors (a schedule) are read by the epilogue by pointer: a tensor beta costs no
    launch; beta, eps_low (float64), eps_high and entropy_coef together one (their cat). No host read."""
    one = GTPOConfig.preset("grpo", beta=torch.tensor(0.04), entropy_threshold=None)
    four = one.replace(eps_low=torch.tensor(0.2, dtype=torch.float64), eps_high=torch.tensor(0.28),
                       entropy_coef=torch.tensor(0.01))
    for cfg, most in ((one, 4), (four, 5)):
        counts = _loss_counts(cfg, packed, validate=False)
        assert counts[0] == counts[1], counts
        launches, reads, creations, kernels = counts[0]
        assert reads == 0 and creations == 0 and launches == most, counts
        assert kernels == {"_vocab_fwd_kernel": 1, "_epilogue_kernel": 1, "_vocab_bwd_kernel": 1}, kernels


@pytest.mark.parametrize("num_items", [37, 37.0, "tensor"])
def test_num_items_tensor_and_per_token_temperature_stay_on_the_path(num_items):
    """num_items_in_batch a tensor (read by pointer) or a number (by value; its rounding to the loss's dtype
    checked on the host without a tensor, where a CPU tensor was made and read: 1 host read and 1 tensor
    from host data counted)."""
    n = torch.tensor(37.0) if num_items == "tensor" else num_items
    counts = _loss_counts("dapo", False, validate=False, num_items_in_batch=n)
    assert counts[0] == counts[1] and counts[0][0] <= 4 and counts[0][1:3] == (0, 0), counts


@pytest.mark.parametrize("per", ["completion", "token"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_temperature_per_completion_or_token_takes_four(per, packed):
    """A temperature tensor on the 3-launch path: the 4 launches, nothing more (the vocabulary kernels read one
    per completion at each token's completion, and a tau that is not finite and > 0 as NaN; no spread to the
    tokens, no check launched)."""
    def prepare(k, B, T, logits, ids, adv, mask, kw):
        tau = torch.full((B, 1), 0.7) if per == "completion" else torch.full(ids.shape, 0.7)
        x = logits.requires_grad_()
        return lambda: gtpo_loss(x, ids, adv, mask, config="gtpo", temperature=tau, validate=False,
                                 backend="triton", **kw), x
    counts = _counts(prepare, packed)
    assert counts[0] == counts[1], counts
    assert counts[0][0] <= 4 and counts[0][1:3] == (0, 0) and counts[0][3].get("_epilogue_kernel") == 1, counts


@pytest.mark.parametrize("validate,reads,mask_dtype,tau,packed", [
    (False, 0, torch.bool, "number", False), (True, 1, torch.float32, "number", False),
    (False, 0, None, "completion", True), (True, 1, torch.bool, "completion", False),
    (False, 0, torch.float32, "token", False), (True, 1, None, "token", True)])
def test_token_logprobs_one_launch(validate, reads, mask_dtype, tau, packed):
    """One launch, validating or not: the forward kernel checks the mask values and ids too and writes the
    status word, the one host read (a float mask: its values checked there too); a temperature per completion
    is read at each token's completion (packed: found in cu_seqlens), per token at the token, none spread or
    checked by a launch of its own. The first validating call of a thread on a stream makes the kernel's
    counter, one launch more, once: the warm-up call."""
    token_logprobs(*_batch(4, 2, 9, False)[:2], 0.7, validate=validate, backend="triton")
    counts = []
    for k, (B, T) in enumerate(SIZES):
        logits, ids, _, mask, kw = _batch(B, T, k, packed)
        kw = {"cu_seqlens": kw["cu_seqlens"]} if packed else {}
        t = {"number": 0.7, "completion": torch.rand(B) + 0.5, "token": torch.rand(ids.shape) + 0.5}[tau]
        mask = None if packed else mask.to(mask_dtype)
        with counting() as c:
            token_logprobs(logits, ids, t, mask, validate=validate, backend="triton", **kw)
        counts.append((c.launches, c.host_reads, c.creations, dict(c.triton_names)))
    assert counts[0] == counts[1], counts
    assert counts[0] == (1, reads, 0, {"_vocab_fwd_kernel": 1}), counts


def test_counter_sees_launches_and_reads():
    """The counter itself: an eager surrogate's ops are counted, and so is a host read."""
    with counting() as c:
        x = torch.randn(5)
        y = (x * 2).sum()
        bool(y > 0)
    assert c.aten >= 3 and c.host_reads == 0  # bool() here is the test's own, not the package's
    logits, ids, adv, mask, kw = _batch(4, 5, 0, False)
    with counting() as c:
        gtpo_loss(logits.requires_grad_(), ids, adv, mask, backend="triton", validate=False,
                  config=GTPOConfig.preset("vespo", vespo_k_pos=torch.tensor(2.0)), **kw).loss.backward()
    assert c.launches > 20  # the eager path of what the epilogue does not cover (vespo's numbers as tensors)


if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):  # pragma: no cover - conftest sets it
    pytestmark = pytest.mark.skip("needs Triton's interpreter")


def _head_counts(schedule, tiles, preset, packed=False, bias=False):
    """Counts of linear_gtpo_loss with `tiles` tiles of rows (every token counted): forward and backward
    apart, each (launches, host reads, Triton kernels by name)."""
    from gtpo_kernels import linear_gtpo_loss
    from gtpo_kernels.pipeline.head import row_bytes
    g = torch.Generator().manual_seed(tiles)
    B, T, D, V = 8, 6, 8, 40
    h = torch.randn(B * T, D, generator=g) if packed else torch.randn(B, T, D, generator=g)
    w = torch.randn(V, D, generator=g).requires_grad_()
    b = torch.randn(V, generator=g).requires_grad_() if bias else None
    ids = torch.randint(0, V, h.shape[:-1], generator=g)
    adv = torch.randn(B, generator=g)
    kw = dict(cu_seqlens=torch.arange(0, B * T + 1, T), max_seqlen=T) if packed else {}
    h.requires_grad_()
    budget = (B * T // tiles) * row_bytes(V, torch.float32, h.device)
    cfg = GTPOConfig.preset(preset, beta=0.0) if preset in ("grpo", "dapo") else \
        GTPOConfig.preset(preset, entropy_threshold=5.0) if preset == "gtpo" else GTPOConfig.preset(preset)
    with counting() as fwd:
        out = linear_gtpo_loss(h, w, ids, adv, bias=b, group_size=4, config=cfg, validate=False, backend="triton",
                               memory_budget=budget, schedule=schedule, **kw)
    with counting() as bwd:
        out.loss.backward()
    assert torch.isfinite(out.loss) and w.grad.abs().sum() > 0 and h.grad.abs().sum() > 0
    return [(c.launches, c.host_reads, dict(c.triton_names), c.creations) for c in (fwd, bwd)]


@pytest.mark.parametrize("schedule", ["fused", "recompute"])
@pytest.mark.parametrize("preset,packed,bias", [("grpo", False, False), ("gtpo", True, True), ("dapo", False, True),
                                                ("gspo", True, False)])
def test_head_runs_the_loss_math_once_and_at_most_ten_launches_a_tile(schedule, preset, packed, bias):
    """The LM head (spec 11): the loss math (the epilogue kernel) once per call, and on each fused tile for
    its own completions; at most 10 launches a tile (a tile of the forward, and of the backward: the
    recompute schedule's backward tiles are blocks of rows x vocabulary entries), the rest of the call
    flat in tiles (at most 60 launches: the batch's preparation, packed or padded, the conflict weights'
    kernel, the gradients' buffers)."""
    per_fwd = []
    for k in (2, 4, 8):
        (lf, rf, kf, cf), (lb, rb, kb, cb) = _head_counts(schedule, k, preset, packed, bias)
        per_fwd.append(lf)
        assert kf["_vocab_fwd_kernel"] == k and kf["_epilogue_kernel"] == (k + 1 if schedule == "fused" else 1), kf
        assert "_epilogue_kernel" not in kb, kb
        tiles_b = kb.get("_vocab_bwd_kernel", 0) + kf.get("_vocab_bwd_kernel", 0)
        assert tiles_b >= k, (kf, kb)
        assert lf + lb <= 60 + 10 * (k + (tiles_b if schedule == "recompute" else 0)), (k, lf, lb, kf, kb)
        # host reads: the plan's one (the rows per completion; 3 before the counted rows were listed in a size
        # the host knows), the recompute backward's rows, and packed without a validated max_seqlen, whether the
        # longest completion fits a tile (the fused schedule's condition: head_ops._longest_fits)
        assert rf + rb == (1 if schedule == "fused" else 2) + (schedule == "fused" and packed), (rf, rb)
        assert cf + cb == 0, (cf, cb)  # nothing copied to the device (the fused plan is formed there)
    assert per_fwd[1] - per_fwd[0] == (per_fwd[2] - per_fwd[1]) / 2 <= 2 * 10, per_fwd  # linear in tiles


def _from_logps_counts(preset, packed, validate, entropy=True, sizes=SIZES):
    """gtpo_loss_from_logps on Triton: counts of the call alone (the log-probs and entropies made before)."""
    from gtpo_kernels import gtpo_loss_from_logps

    def prepare(k, B, T, logits, ids, adv, mask, kw):
        lp, H = _logps_of(logits, ids)
        return lambda: gtpo_loss_from_logps(lp, ids, adv, mask, entropy=H if entropy else None, config=_config(preset),
                                            validate=validate, backend="triton", **kw), lp
    return _counts(prepare, packed, sizes)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("preset", FAST)
def test_from_logps_at_most_four_launches(preset, packed):
    """gtpo_loss_from_logps (spec 8): the prep kernel (float32 log-probs and entropies, the epilogue's
    cu_seqlens), the epilogue, the seed, the backward's c g; no host read, no tensor from host data."""
    counts = _from_logps_counts(preset, packed, validate=False)
    assert counts[0] == counts[1], counts  # flat in tokens and completions
    launches, reads, creations, kernels = counts[0]
    assert reads == 0 and creations == 0 and launches <= 4, counts
    assert kernels == {"_prep_kernel": 1, "_epilogue_kernel": 1, "_scale_kernel": 1}, kernels


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_from_logps_without_entropy_and_validating(packed):
    """No entropies (a config that needs none): the same 4 launches; validating, the input checks and the
    status word in one host read."""
    counts = _from_logps_counts("grpo", packed, validate=False, entropy=False)
    assert counts[0] == counts[1] and counts[0][0] <= 4 and counts[0][1:3] == (0, 0), counts
    counts = _from_logps_counts("gtpo", packed, validate=True)  # the checks in the kernels, their status word read
    assert counts[0] == counts[1] and counts[0][0] <= 4 and counts[0][1:3] == (1, 0), counts


def _sampling_mask(logits, ids, mask, k=5):
    """Kept sets as an engine records them: each counted row's top k ids, with its sampled id."""
    rows, y = (logits, ids) if mask is None else (logits[mask], ids[mask])
    top = rows.topk(k, -1).indices
    sets = [sorted(set(top[r].tolist()) | {int(y[r])}) for r in range(rows.shape[0])]
    offsets = torch.tensor([0] + [len(s) for s in sets]).cumsum(0)
    return torch.tensor([v for s in sets for v in s]), offsets


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_recorded_kept_sets_at_most_eight_launches(packed):
    """gtpo_loss with sampling_mask (spec 8: at most 8 for replay): the sets' flat layout, the replay, the
    sets' checks, the epilogue; the seed, c g and e g, the gradient's zeros, the replay's gradient kernel.
    No host read and no tensor from host data unvalidated; the same counts at two sizes. Packed, with rollout
    weights per completion (B, 1) (the epilogue reads them: no launch more)."""
    def prepare(k, B, T, logits, ids, adv, mask, kw):
        kw.pop("ref_logps")
        if packed:
            kw["rollout_is_weights"] = torch.rand(B, 1, generator=torch.Generator().manual_seed(k)) + 0.5
        sets = _sampling_mask(logits, ids, mask)
        x = logits.requires_grad_()
        return lambda: gtpo_loss(x, ids, adv, mask, sampling_mask=sets, config="gtpo", validate=False,
                                 backend="triton", **kw), x
    counts = _counts(prepare, packed)
    assert counts[0] == counts[1], counts
    launches, reads, creations, kernels = counts[0]
    assert reads == 0 and creations == 0 and launches <= 8, counts
    assert kernels == {"_flat_sets_kernel": 1, "_replay_fwd_kernel": 1, "_set_check_kernel": 1,
                       "_epilogue_kernel": 1, "_scale_kernel": 1, "_replay_bwd_kernel": 1}, kernels


@pytest.mark.parametrize("packed,validate", [(False, False), (True, True)], ids=["padded", "packed-validated"])
def test_rules_rebuilt_sets_at_most_eight_launches(packed, validate):
    """gtpo_loss with top_k, top_p and min_p (spec 8: at most 8 for replay; the rebuild was 160 launches and 5
    host reads): the kernel writing each token's kept set as a threshold, the forward vocabulary kernel over it,
    the epilogue (spec 13's metrics in it), the seed, the backward kernel. Numbers, and a per-token top_k tensor
    (read by the kernel: no launch more); unvalidated no host read, validating one; the same counts at two
    sizes."""
    def prepare(k, B, T, logits, ids, adv, mask, kw):
        kw.pop("ref_logps")
        rules = dict(top_k=6, top_p=0.9, min_p=0.01) if packed else dict(
            top_k=torch.randint(0, 8, ids.shape, generator=torch.Generator().manual_seed(k)), top_p=0.95)
        x = logits.requires_grad_()
        return lambda: gtpo_loss(x, ids, adv, mask, config="gtpo", validate=validate, backend="triton", **rules,
                                 **kw), x
    counts = _counts(prepare, packed, ((4, 3), (8, 4)))  # (small: the rebuild reads each row many times)
    assert counts[0] == counts[1], counts
    launches, reads, creations, kernels = counts[0]
    assert reads == int(validate) and creations == 0 and launches <= 5, counts
    assert kernels == {"_kept_rule_kernel": 1, "_vocab_fwd_kernel": 1, "_epilogue_kernel": 1,
                       "_vocab_bwd_kernel": 1}, kernels


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("per", ["token", "completion"])
@pytest.mark.parametrize("validate", [False, True])
def test_rules_with_a_temperature_tensor_stay_on_the_path(validate, per, packed):
    """Sets rebuilt by top_k with a temperature per token or per completion: gtpo_loss validating took 23 / 24
    launches and token_logprobs unvalidated 17 / 18 (the temperature's check and NaN fill formed by a dozen
    torch ops, where the kernels flag and NaN such a tau themselves); then 6 / 7 and 2 / 3, one per completion
    spread on the tokens (packed: 9 and 5, the spread's searchsorted and three ops more); now the rules' kernel
    reads it at each token's completion as the vocabulary kernels do: 5 and 2 in every form, the four kernels
    alone, the same errors (tests/test_temperature.py) and NaN tokens as before."""
    def prepare(k, B, T, logits, ids, adv, mask, kw):
        kw.pop("ref_logps")
        g = torch.Generator().manual_seed(k)
        tau = torch.rand(ids.shape, generator=g) + 0.5 if per == "token" else torch.rand(B, generator=g) + 0.5
        x = logits.requires_grad_()
        return lambda: gtpo_loss(x, ids, adv, mask, config="gtpo", validate=validate, backend="triton", top_k=6,
                                 temperature=tau, **kw), x
    counts = _counts(prepare, packed, ((4, 3), (8, 4)))
    assert counts[0] == counts[1], counts
    launches, reads, creations, kernels = counts[0]
    assert reads == int(validate) and creations == 0 and launches <= 5, counts
    assert kernels == {"_kept_rule_kernel": 1, "_vocab_fwd_kernel": 1, "_epilogue_kernel": 1,
                       "_vocab_bwd_kernel": 1}, kernels
    B, T, V = 4, 3, 24
    logits, ids, _, mask, kw = _batch(B, T, 0, packed)
    tau = torch.rand(ids.shape) + 0.5 if per == "token" else torch.rand(B) + 0.5
    form = {k: kw[k] for k in ("cu_seqlens", "max_seqlen")} if packed else {}
    token_logprobs(logits, ids, tau, mask, top_k=6, validate=validate, backend="triton", **form)  # (its status
    with counting() as c:  # word's counter is made on a device's first validated call)
        token_logprobs(logits, ids, tau, mask, top_k=6, validate=validate, backend="triton", **form)
    assert c.launches <= 2 and c.host_reads == int(validate) and c.creations == 0, (c.launches, dict(c.ops))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("policy", ["cispo", "sapo", "gpg", "verl-cispo", "dppo-tv", "dppo-kl", "geo-mean", "vespo"])
def test_other_token_level_policy_terms_take_at_most_four(policy, packed):
    """cispo, sapo and verl's token-level terms (their presets; geo_mean, verl's GMPO, at the completion
    level through its log R) on the 4-launch path, as the PPO clip: the epilogue kernel computes them (its
    POLICY switch), no host read, no tensor from host data, the same counts at two sizes (the eager path of
    these terms was ~95 launches, geo_mean's 127, vespo's 121)."""
    counts = _loss_counts(policy, packed, validate=False)
    assert counts[0] == counts[1], counts  # flat in tokens and completions
    launches, reads, creations, kernels = counts[0]
    assert reads == 0 and creations == 0, counts
    assert launches <= 4, counts
    assert kernels == {"_vocab_fwd_kernel": 1, "_epilogue_kernel": 1, "_vocab_bwd_kernel": 1}, kernels



@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("policy", ["cispo", "sapo"])
def test_other_policy_terms_from_logps_at_most_four_launches(policy, packed):
    """gtpo_loss_from_logps with cispo and sapo: the same 4 launches as the PPO clip's (the epilogue computes
    them there too), no host read, no tensor from host data, flat in tokens and completions."""
    counts = _from_logps_counts(policy, packed, validate=False)
    assert counts[0] == counts[1], counts
    launches, reads, creations, kernels = counts[0]
    assert reads == 0 and creations == 0 and launches <= 4, counts
    assert kernels == {"_prep_kernel": 1, "_epilogue_kernel": 1, "_scale_kernel": 1}, kernels


def _roll_counts(packed, cfg, validate=False, weights=None, rollout=False, from_logps=False, sizes=((4, 3), (8, 4))):
    """Counts of gtpo_loss (or gtpo_loss_from_logps) with rollout weights ("token": per token, "completion":
    (B, 1)) and / or rollout log-probs, config `cfg` (the off-policy mask's threshold in it)."""
    from gtpo_kernels import gtpo_loss_from_logps

    def prepare(k, B, T, logits, ids, adv, mask, kw):
        kw.pop("ref_logps")
        g = torch.Generator().manual_seed(k)
        if weights:
            kw["rollout_is_weights"] = torch.rand(ids.shape if weights == "token" else (B, 1), generator=g) + 0.5
        if rollout:
            kw["rollout_logps"] = kw["old_logps"] + 0.1 * torch.randn(ids.shape, generator=g)
        if from_logps:
            x, H = _logps_of(logits, ids)
            return lambda: gtpo_loss_from_logps(x, ids, adv, mask, entropy=H, config=cfg, validate=validate,
                                                backend="triton", **kw), x
        x = logits.requires_grad_()
        return lambda: gtpo_loss(x, ids, adv, mask, config=cfg, validate=validate, backend="triton", **kw), x
    counts = _counts(prepare, packed, sizes)
    assert counts[0] == counts[1], counts  # flat in tokens and completions
    return counts[0]


_KERNELS = {"_vocab_fwd_kernel": 1, "_epilogue_kernel": 1, "_vocab_bwd_kernel": 1}
_OFF = GTPOConfig.preset("gtpo", off_policy_mask_threshold=0.01)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("case", ["token-weights", "off-policy-old", "off-policy-rollout-token-weights"])
def test_rollout_weights_and_off_policy_mask_take_at_most_four(case, packed):
    """Rollout weights per token and the off-policy mask (its sampling log-probs the old ones, or the rollout
    ones) on the 4-launch path (the epilogue kernel computes them; the eager path took ~130-150 launches): no
    host read, no tensor from host data, the same counts at two sizes."""
    cfg = GTPOConfig.preset("gtpo") if case == "token-weights" else _OFF
    launches, reads, creations, kernels = _roll_counts(packed, cfg, weights="token" if "token" in case else None,
                                                       rollout="rollout" in case)
    assert reads == 0 and creations == 0 and launches <= 4, (launches, reads, creations)
    assert kernels == _KERNELS, kernels


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_validated_rollout_weights_take_four_launches_and_one_read(packed):
    launches, reads, creations, kernels = _roll_counts(packed, _OFF, validate=True, weights="token")
    assert reads == 1 and launches <= 4 and kernels == _KERNELS, (launches, reads, kernels)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_per_completion_rollout_weights_take_at_most_four(packed):
    """Per-completion weights (B, 1): the epilogue reads them per completion, and the batch's preparation no
    longer repeats them on the tokens (a Lazy of core/batch.rollout_weights: it was 7 launches padded, 14
    packed): the 4 launches of per-token weights."""
    launches, reads, creations, kernels = _roll_counts(packed, _OFF, weights="completion")
    assert kernels == _KERNELS, kernels
    assert reads == 0 and creations == 0 and launches <= 4, (launches, reads, creations)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_from_logps_off_policy_mask_at_most_four_launches(packed):
    """gtpo_loss_from_logps with the off-policy mask (rollout log-probs as its sampling policy) and rollout
    weights (per token padded, per completion packed: the epilogue reads them): the same 4 launches as
    without them (the eager path took ~140-170)."""
    launches, reads, creations, kernels = _roll_counts(packed, _OFF, rollout=True, from_logps=True,
                                                       weights="completion" if packed else "token")
    assert reads == 0 and creations == 0 and launches <= 4, (launches, reads, creations)
    assert kernels == {"_prep_kernel": 1, "_epilogue_kernel": 1, "_scale_kernel": 1}, kernels


_TOP = GTPOConfig.preset("gtpo", top_entropy_quantile=0.2)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("validate", [False, True], ids=["unvalidated", "validating"])
def test_top_entropy_mask_takes_at_most_eight(validate, packed):
    """The top-entropy mask (spec 9) on the epilogue path: two launches more than the 4 (the entropies' sort key
    and torch.sort; the eager path took 143), none reading the host unvalidated and the status word the one
    read validating, no tensor from host data, the same counts at two sizes."""
    launches, reads, creations, kernels = _roll_counts(packed, _TOP, validate=validate)
    assert reads == int(validate) and creations == 0 and launches <= 8, (launches, reads, creations)
    assert kernels == dict(_KERNELS, _entropy_key_kernel=1), kernels


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_from_logps_top_entropy_mask_at_most_six_launches(packed):
    """gtpo_loss_from_logps with the top-entropy mask (entropies given): its 4 launches and the two of the
    sort."""
    launches, reads, creations, kernels = _roll_counts(packed, _TOP, from_logps=True)
    assert reads == 0 and creations == 0 and launches <= 6, (launches, reads, creations)
    assert kernels == {"_prep_kernel": 1, "_entropy_key_kernel": 1, "_epilogue_kernel": 1, "_scale_kernel": 1}, kernels


@pytest.mark.parametrize("validate", [False, True], ids=["unvalidated", "validating"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("policy", ["clip-cov", "kl-cov"])
def test_cov_terms_take_at_most_eight(policy, packed, validate):
    """verl's clip_cov and kl_cov on the epilogue (kernels/epilogue_cov.py): the 4 launches, the epilogue's
    key launch and the keys' sort, and clip_cov's draw (7 and 6; the eager path took 144 and 126), no host
    read unvalidated and the status word validating, no tensor from host data, the same at two sizes."""
    launches, reads, creations, kernels = _roll_counts(packed, GTPOConfig.preset(policy), validate=validate)
    assert reads == int(validate) and creations == 0 and launches <= 6 + (policy == "clip-cov"), (launches, reads)
    assert kernels == dict(_KERNELS, _epilogue_kernel=2), kernels
