"""The TRL adapter against TRL 1.16's stock GRPOTrainer: it trains with our kernel; every loss type and
option gives the stock loss and gradients (logits head and fused head); evaluation normalizers; the old
and reference passes; GTPO's conflict weights and entropy control on top; the config mapping and its
refusals. Tiny models on the CPU (trl_setup.py); skipped without TRL."""
import pytest
import torch

import gtpo_kernels
from trl_setup import _configure, _old_logps_both, _trl_losses, _trl_setup, needs_trl
from trl_setup import _one_torch_thread, head_spy, kernel_spy, trl_pair  # noqa: F401 (fixtures)


# ---------------------------------------------------------------- TRL

@needs_trl
def test_trl_trainer_trains_with_our_kernel(tmp_path, kernel_spy, monkeypatch):
    from gtpo_kernels.integrations.trl import GTPOTrainer, GTPOTrainerConfig
    # gradient accumulation 2 with one generation per 2 micro-batches: the weights are computed on the
    # whole generation batch, then shuffled and split by TRL
    tr = _trl_setup(tmp_path, GTPOTrainer, GTPOTrainerConfig, per_device_train_batch_size=4,
                    gradient_accumulation_steps=2, gtpo_loss="gtpo",
                    gtpo_kwargs={"entropy_threshold": 5.0})  # tiny random model: entropy ~3.4 nats

    # no log_softmax anywhere inside our loss computation
    inside = {"on": False}
    orig_ls = torch.Tensor.log_softmax
    orig_fls = torch.nn.functional.log_softmax

    def no_ls(fn):
        def wrapped(*a, **k):
            if inside["on"]:
                kernel_spy["log_softmax_in_loss"] += 1
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(torch.Tensor, "log_softmax", no_ls(orig_ls))
    monkeypatch.setattr(torch.nn.functional, "log_softmax", no_ls(orig_fls))
    monkeypatch.setattr(torch, "log_softmax", no_ls(torch.log_softmax))
    orig_cl = tr._compute_loss

    def compute_loss_watched(model, inputs):
        assert "gtpo_lam" in inputs and inputs["gtpo_lam"].shape == inputs["completion_ids"].shape
        inside["on"] = True
        try:
            return orig_cl(model, inputs)
        finally:
            inside["on"] = False
    monkeypatch.setattr(tr, "_compute_loss", compute_loss_watched)

    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.train()
    assert tr._gtpo_calls == 6  # 3 optimizer steps x 2 micro-batches
    assert kernel_spy["vocab_fwd"] >= tr._gtpo_calls
    assert kernel_spy["log_softmax_in_loss"] == 0
    logs = [h for h in tr.state.log_history if "gtpo/conflict_frac" in h]
    assert len(logs) == 3
    for h in logs:
        for key in ("entropy", "gtpo/clip_frac", "gtpo/filtered_frac", "gtpo/conflict_frac", "gtpo/mean_entropy"):
            assert key in h and h[key] == h[key], key  # present, not NaN
        assert 0.0 <= h["gtpo/conflict_frac"] <= 1.0 and h["entropy"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters())), "no parameter moved"


TRL_CASES = [
    ("grpo", {}, None),
    ("bnpo", dict(loss_type="bnpo"), None),
    ("dr_grpo", dict(loss_type="dr_grpo"), None),
    ("dapo", dict(loss_type="dapo"), None),
    ("cispo", dict(loss_type="cispo", epsilon_high=1.3), None),  # a bound the perturbed ratios exceed
    ("sapo", dict(loss_type="sapo", sapo_temperature_pos=1.3, sapo_temperature_neg=0.8), None),
    ("luspo", dict(loss_type="luspo", importance_sampling_level="sequence"), None),
    ("luspo-token", dict(loss_type="luspo"), None),
    ("vespo", dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=2.5), None),
    ("gspo", dict(importance_sampling_level="sequence"), None),
    ("grpo-delta", dict(delta=1.3), None),
    ("dapo-delta", dict(loss_type="dapo", delta=1.3), None),
    ("grpo-kl-bias", dict(beta=0.1, use_bias_correction_kl=True), None),
    ("grpo-delta-inside-clip", dict(delta=1.1), None),  # delta < 1 + epsilon_high: it caps the clip metrics too
    ("dapo-kl", dict(loss_type="dapo", beta=0.1, use_bias_correction_kl=False), None),
    ("gspo-kl-bias", dict(importance_sampling_level="sequence", beta=0.1), None),
    ("grpo-offpolicy-mask", dict(off_policy_mask_threshold=0.0), None),
    ("dapo-offpolicy-mask-vllm", dict(loss_type="dapo", off_policy_mask_threshold=0.0), "token_truncate"),
    ("grpo-top-entropy", dict(top_entropy_quantile=0.3), None),
    ("luspo-top-entropy", dict(loss_type="luspo", importance_sampling_level="sequence",
                               top_entropy_quantile=0.5), None),
    ("grpo-vllm-token-truncate", {}, "token_truncate"),
    ("dapo-vllm-token-mask", dict(loss_type="dapo"), "token_mask"),
    ("bnpo-vllm-sequence-truncate", dict(loss_type="bnpo"), "sequence_truncate"),
    ("sapo-vllm-sequence-mask", dict(loss_type="sapo"), "sequence_mask"),
    ("vespo-vllm-token-truncate", dict(loss_type="vespo"), "token_truncate"),
    ("cispo-kl-bias-vllm", dict(loss_type="cispo", epsilon_high=1.3, beta=0.1), "token_truncate"),
]


@needs_trl
@pytest.mark.parametrize("case,opts,vllm_mode", TRL_CASES, ids=[c[0] for c in TRL_CASES])
def test_trl_loss_types_equal_stock_loss(trl_pair, kernel_spy, head_spy, case, opts, vllm_mode):
    """gtpo_loss=None + TRL's loss_type (and options) gives the stock GRPOTrainer's loss and parameter
    gradients on the same off-policy batch (temperature 0.7, float32), with gradient accumulation 2 and
    steps_per_generation 4 so that every normalizer's factors matter. The adapter's default head: the
    backbone's hidden states and the LM head's weight into linear_gtpo_loss (no logits)."""
    calls0 = kernel_spy["vocab_fwd"]
    seen = {w: {k: len(v) for k, v in trl_pair[w]._metrics["train"].items()} for w in ("ours", "stock")}
    ours, stock, g_ours, g_stock = _trl_losses(trl_pair, opts, vllm_mode, accum=2, spg=4)
    assert kernel_spy["vocab_fwd"] > calls0, "gtpo_loss's vocabulary kernel did not run"
    assert trl_pair["ours"]._gtpo_calls > 0
    assert head_spy["linear_gtpo_loss"] == 1 and head_spy["gtpo_loss"] == 0, head_spy
    assert abs(stock.item()) > 1e-4
    loss_rel = abs(ours.double() - stock.double()).item() / abs(stock.item())
    grad_rel = 0.0
    for (name, _), p, q in zip(trl_pair["stock"].model.named_parameters(), g_ours, g_stock):
        if q.norm() > 0 or p.norm() > 0:
            grad_rel = max(grad_rel, ((p - q).norm() / q.norm().clamp(min=1e-30)).item())
    print(f"\nTRL {case:32s} loss {stock.item():+.6f}  loss rel err {loss_rel:.2e}  grad rel err {grad_rel:.2e}")
    assert loss_rel < 1e-5, (ours.item(), stock.item())
    assert grad_rel < 1e-5, grad_rel
    # our metrics went through TRL's metric store, with TRL's entropy
    torch.testing.assert_close(torch.tensor(trl_pair["ours"]._metrics["train"]["entropy"][-1]),
                               torch.tensor(trl_pair["stock"]._metrics["train"]["entropy"][-1]),
                               rtol=1e-5, atol=1e-6)
    clip_keys = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                 "clip_ratio/high_max", "cispo_clip_ratio", "vespo/phi_seq_mean")  # TRL's, by its definitions
    logged = [{k: trl_pair[w]._metrics["train"][k][-1] for k in clip_keys  # (those this case logged)
               if len(trl_pair[w]._metrics["train"].get(k, [])) > seen[w].get(k, 0)} for w in ("ours", "stock")]
    assert sorted(logged[0]) == sorted(logged[1]), logged
    for k, v in logged[1].items():
        assert logged[0][k] == pytest.approx(v, rel=1e-5, abs=1e-7, nan_ok=True), (k, logged)
    if opts.get("beta", 0) > 0:  # and TRL's kl (times the ratio with use_bias_correction_kl, as TRL logs it)
        kl = [trl_pair[k]._metrics["train"]["kl"][-1] for k in ("ours", "stock")]
        assert kl[1] > 0 and kl[0] == pytest.approx(kl[1], rel=1e-5), kl
    base = {k: v for k, v in opts.items() if k in ("loss_type", "epsilon_high")}
    if opts != base or vllm_mode is not None:  # the option under test changed the stock loss
        _, without, _, _ = _trl_losses(trl_pair, base, None, accum=2, spg=4)
        assert abs((without - stock).item()) > 1e-6 * abs(stock.item()), f"{case}: the option did not matter"


@needs_trl
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_trl_eval_mode_normalizers(trl_pair, loss_type):
    """In eval TRL drops the accumulation factors; so do we."""
    ours, stock, _, _ = _trl_losses(trl_pair, dict(loss_type=loss_type), None, accum=3, spg=6, train=False)
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-7)


@needs_trl
@pytest.mark.parametrize("case", ["grpo", "dapo-kl", "luspo-top-entropy", "vespo-vllm-token-truncate"])
def test_trl_logits_head_equals_stock_loss(trl_pair, head_spy, case):
    """gtpo_head='logits' (the debugging path: the model's logits and gtpo_loss) and the fused head in
    tiles of 2 tokens (gtpo_memory_budget) give the same loss and gradients as the stock trainer; the
    fused head's two schedules both run."""
    _, opts, vllm_mode = next(c for c in TRL_CASES if c[0] == case)
    ours_tr = trl_pair["ours"]
    fused = _trl_losses(trl_pair, opts, vllm_mode, accum=2, spg=4)
    V = ours_tr.model.config.vocab_size
    ours_tr.args.gtpo_memory_budget = 2 * 2 * V * 4  # 2 float32 tokens (and their gradient) per tile
    try:
        tiled = _trl_losses(trl_pair, opts, vllm_mode, accum=2, spg=4)
        ours_tr.args.gtpo_head = "logits"
        logits = _trl_losses(trl_pair, opts, vllm_mode, accum=2, spg=4)
    finally:
        ours_tr.args.gtpo_head, ours_tr.args.gtpo_memory_budget = "fused", None
        _configure(ours_tr)
    assert head_spy["linear_gtpo_loss"] == 2 and head_spy["gtpo_loss"] == 1, head_spy
    # the 3-GEMM schedule where each tile's coefficients are local (whole completions in a tile for
    # vespo's per-completion weight), the recompute one otherwise
    local = case not in ("luspo-top-entropy", "vespo-vllm-token-truncate")
    assert head_spy["schedules"] == [0 if case == "luspo-top-entropy" else 1, 1 if local else 0]
    for ours, stock, g_ours, g_stock in (fused, tiled, logits):
        assert abs(ours.double() - stock.double()).item() < 1e-5 * abs(stock.item())
        for p, q in zip(g_ours, g_stock):
            assert (p - q).norm() <= 1e-5 * q.norm().clamp(min=1e-30)
    with pytest.raises(ValueError, match="gtpo_head"):
        ours_tr.args.gtpo_head = "chunked"
        try:
            ours_tr._gtpo_setup()
        finally:
            ours_tr.args.gtpo_head = "fused"
    ours_tr._gtpo_setup()


@needs_trl
def test_trl_old_and_ref_passes_use_linear_token_logprobs(trl_pair, head_spy):
    """The old-policy and reference passes (TRL's _get_per_token_logps_and_entropies, no gradient) run
    through linear_token_logprobs, chunked over rows as TRL does, and equal TRL's own fused head."""
    tr = trl_pair["ours"]
    calls0 = tr._gtpo_logprob_calls
    (lp, ent, aux), (lp_t, ent_t, _) = _old_logps_both(tr, trl_pair["batch"], batch_size=3)
    assert tr._gtpo_logprob_calls - calls0 == 3 and head_spy["linear_token_logprobs"] == 3  # rows 8 = 3 + 3 + 2
    assert aux is None and lp.shape == lp_t.shape == trl_pair["batch"]["completion_ids"].shape
    torch.testing.assert_close(lp, lp_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_t, rtol=1e-5, atol=1e-5)
    # with a gradient (not a TRL pass) the method is TRL's own
    ids = torch.cat([trl_pair["batch"]["prompt_ids"], trl_pair["batch"]["completion_ids"]], 1)
    am = torch.ones_like(ids)
    tr._get_per_token_logps_and_entropies(tr.model, ids, am, 4)
    assert head_spy["linear_token_logprobs"] == 3


def _gtpo_on_top_against_reference(tr, batch, G=4):
    """The adapter's conflict weights on `batch` (a positive and a negative completion of each group made
    to share their first two tokens) against the float64 reference per group, then its loss with them
    against the reference GTPO loss on the model's logits (one micro-batch, no accumulation)."""
    import dataclasses

    import gtpo_reference as ref
    from gtpo_kernels.integrations.trl_config import _loss_mask
    cfg, batch = tr.gtpo_config, dict(batch)
    ids, adv = batch["completion_ids"].clone(), batch["advantages"]
    for g in range(ids.size(0) // G):
        rows = range(g * G, (g + 1) * G)
        pos, neg = next(i for i in rows if adv[i] > 0), next(i for i in rows if adv[i] < 0)
        ids[neg, :2] = ids[pos, :2]
    batch["completion_ids"] = ids
    m = _loss_mask(batch) != 0
    lam, n_conf = tr._gtpo_conflict_weights(batch, G)
    lam_r, n_r = ref.conflict_weights(ids, m, adv, G, cfg.conflict_pos_weight, cfg.conflict_neg_weight)
    assert {0.5, 0.25} & set(lam_r[m].tolist()), lam_r  # conflict tokens of negative completions: w_neg
    assert torch.equal(lam.double()[m], lam_r[m]) and torch.equal(n_conf.double(), n_r)
    tr.args.steps_per_generation = tr.current_gradient_accumulation_steps = 1
    tr.model.train()
    losses = []
    for w in ((lam, n_conf), (torch.ones_like(lam), torch.ones_like(n_conf))):
        batch["gtpo_lam"], batch["gtpo_n_conf"] = w
        with torch.no_grad():
            losses.append(float(tr._compute_loss(tr.model, batch)))
    with torch.no_grad():
        T = ids.size(1)
        logits = tr.model(input_ids=torch.cat([batch["prompt_ids"], ids], 1), logits_to_keep=T + 1,
                          attention_mask=torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)).logits
    r = float(ref.gtpo_loss(logits.double(), ids, adv, m, group_size=G, old_logps=batch["old_per_token_logps"],
                            num_items_in_batch=batch["num_items_in_batch"], **dataclasses.asdict(cfg))["loss"])
    assert abs(losses[0] - r) <= 1e-5 * max(1.0, abs(r)), (losses, r)
    assert abs(losses[1] - r) > 1e-3 * abs(r), (losses, r)  # the weights change the loss


@needs_trl
def test_trl_clip_metric_and_gtpo_on_top(trl_pair):
    """gtpo_loss='gtpo' on a TRL loss type: the loss type's policy term with the conflict weights on
    (the weights the adapter computes at advantage time equal the float64 reference's, and the loss
    with them the reference GTPO loss; a w_neg of 0.5 from gtpo_kwargs shows the config reaches
    them); clip metrics are logged."""
    from gtpo_kernels.integrations.trl import gtpo_config_from_args
    ours = trl_pair["ours"]
    _trl_losses(trl_pair, {}, None, accum=1, spg=1)
    assert ours._metrics["train"]["gtpo/clip_frac"][-1] > 0  # the perturbed ratios did clip
    _configure(ours, loss_type="cispo", epsilon_high=5.0)
    ours.args.gtpo_loss = "gtpo"
    try:
        cfg = gtpo_config_from_args(ours.args)
        assert (cfg.policy_loss, cfg.loss_agg, cfg.eps_high, cfg.use_conflict_mask) == ("cispo", "token-mean", 5.0,
                                                                                        True)
        assert cfg.entropy_threshold == pytest.approx(0.6931471805599453) and cfg.entropy_penalty == 0.1
        # no entropy filter: the tiny model's entropy (~3.4 nats) would drop every completion (loss 0)
        ours.args.gtpo_kwargs = {"conflict_neg_weight": 0.5, "entropy_threshold": None}
        ours._gtpo_setup()
        _gtpo_on_top_against_reference(ours, trl_pair["batch"])
    finally:
        ours.args.gtpo_kwargs = None
        _configure(ours)


@needs_trl
def test_trl_config_mapping_and_refusals(tmp_path, trl_pair):
    from trl import GRPOConfig
    from gtpo_kernels.integrations.trl import GTPOTrainerConfig, gtpo_config_from_args

    def args(**kw):
        return GTPOTrainerConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)

    cfg = gtpo_config_from_args(args(temperature=0.8, epsilon=0.1, epsilon_high=0.3, max_completion_length=16,
                                     gtpo_loss="gtpo-official", gtpo_kwargs='{"conflict_pos_weight": 1.5}'))
    assert (cfg.temperature, cfg.eps_low, cfg.eps_high, cfg.max_completion_length) == (0.8, 0.1, 0.3, 16)
    assert cfg.loss_agg == "gtpo-official" and cfg.conflict_pos_weight == 1.5 and cfg.entropy_threshold == 0.7
    # the default: loss_type='grpo' + GTPO's parts = the gtpo preset
    default = gtpo_config_from_args(args())
    assert default.replace(max_completion_length=None) == gtpo_kernels.GTPOConfig.preset("gtpo").replace(
        use_bias_correction_kl=True)
    # a plain GRPOConfig: TRL's default loss_type ('dapo') with GTPO's parts on top
    plain = gtpo_config_from_args(GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True))
    assert plain.use_conflict_mask and plain.loss_agg == "token-mean"
    # every option maps onto its GTPOConfig field
    cfg = gtpo_config_from_args(args(loss_type="luspo", gtpo_loss="luspo", importance_sampling_level="sequence",
                                     delta=1.5, beta=0.05, use_bias_correction_kl=False,
                                     off_policy_mask_threshold=0.3, top_entropy_quantile=0.4,
                                     sapo_temperature_pos=0.9, vespo_k_neg=2.5))
    assert (cfg.policy_loss, cfg.loss_agg, cfg.importance_sampling_level, cfg.use_conflict_mask) == \
        ("ppo", "seq-mean-token-sum", "sequence", False)
    assert (cfg.delta, cfg.beta, cfg.use_bias_correction_kl, cfg.off_policy_mask_threshold,
            cfg.top_entropy_quantile, cfg.sapo_temperature_pos, cfg.vespo_k_neg) == (1.5, 0.05, False, 0.3, 0.4,
                                                                                     0.9, 2.5)
    for kw, match in [(dict(gtpo_kwargs={"temperature": 2.0}), "temperature"),
                      (dict(gtpo_kwargs={"delta": 2.0}), "`delta`"),
                      (dict(gtpo_kwargs={"loss_agg": "token-mean"}), "loss_type"),
                      (dict(gtpo_loss="dapo"), "set loss_type='dapo'"),
                      (dict(gtpo_loss="gspo"), "importance_sampling_level='sequence'"),
                      (dict(gtpo_loss="gtpo-official", loss_type="dapo"), "loss_type='grpo'"),
                      (dict(loss_type="sapo", importance_sampling_level="sequence"), "sequence"),
                      (dict(loss_type="nope"), "loss_type")]:
        with pytest.raises(ValueError, match=match):
            gtpo_config_from_args(args(**kw))
    # TRL's own entropy bonus stays refused
    ours = trl_pair["ours"]
    ours.args.entropy_coef = 0.01
    try:
        with pytest.raises(ValueError, match="entropy_coef"):
            ours._gtpo_setup()
    finally:
        _configure(ours)


@needs_trl
def test_trl_logs_the_rollout_mismatch(trl_pair, monkeypatch, tmp_path):
    """With the engine's log-probs in the batch (`sampling_per_token_logps`, one NaN as vLLM gives), the
    adapter logs spec 14's mismatch of the loss's log-probs under gtpo/: equal to the float64 reference
    on the same log-probs, NaN counted apart. A trainer of its own (accelerate's state is a process-wide
    singleton that another module's trainer may have replaced), on the shared batch."""
    import copy

    import gtpo_reference.gtpo_family as fam
    from gtpo_kernels.integrations.trl import GTPOTrainer, GTPOTrainerConfig
    from gtpo_kernels.integrations.trl_config import _loss_mask
    batch = dict(trl_pair["batch"])
    tr = _trl_setup(tmp_path, GTPOTrainer, GTPOTrainerConfig, model=copy.deepcopy(trl_pair["ours"].model),
                    gtpo_loss=None, temperature=0.7, epsilon=0.2, epsilon_high=0.25, bf16=False)
    _configure(tr)
    tr.args.steps_per_generation = tr.current_gradient_accumulation_steps = 1
    tr.model.train()
    seen = {}
    orig = tr._gtpo_log
    monkeypatch.setattr(tr, "_gtpo_log", lambda mode, out, *a: (seen.update(out=out), orig(mode, out, *a))[1])
    with torch.no_grad():
        tr._compute_loss(tr.model, batch)
    roll = batch["sampling_per_token_logps"]
    m = _loss_mask(batch) != 0
    assert torch.isnan(roll[m]).any() and (m & ~torch.isnan(roll)).any()
    want = fam.rollout_mismatch(seen["out"].logps.double(), roll.double(), m)
    assert want["rollout_abs_diff"] > 0
    for k, v in want.items():
        assert tr._metrics["train"][f"gtpo/{k}"][-1] == pytest.approx(float(v), rel=1e-5, abs=1e-9), k


def test_trl_mismatch_aggregates_over_processes():
    """Across processes spec 14's means are means over all processes' counted tokens whose difference is not
    NaN, the NaN fraction over all counted tokens, the maximum over all: _log_mismatch with a fake
    two-process accelerator (this process's stats summed with another's, maxima gathered) equals the float64
    reference on both processes' tokens together (1e-5 relative)."""
    import types
    from collections import defaultdict

    import gtpo_reference.gtpo_family as fam
    from gtpo_kernels import rollout_mismatch
    from gtpo_kernels.integrations.trl_metrics import _log_mismatch
    g = torch.Generator().manual_seed(8)
    procs = []
    for B, T, nan in ((2, 5, 0.0), (3, 9, 0.4)):  # different token counts and NaN fractions
        lp = -3 * torch.rand(B, T, generator=g)
        roll = lp + 0.3 * torch.randn(B, T, generator=g)
        roll[torch.rand(B, T, generator=g) < nan] = float("nan")
        m = torch.rand(B, T, generator=g) > 0.2
        procs.append((lp.reshape(-1), roll.reshape(-1), m.reshape(-1)))

    def trainer(reduce, gather):
        return types.SimpleNamespace(accelerator=types.SimpleNamespace(reduce=reduce, gather=gather),
                                     _metrics={"train": defaultdict(list)})
    seen = {}
    other = trainer(lambda s, reduction: seen.setdefault("s", s), lambda x: seen.setdefault("max", x))
    lp, roll, m = procs[1]
    _log_mismatch(other, "train", rollout_mismatch(lp, roll, m), m.sum().float())
    tr = trainer(lambda s, reduction: s + seen["s"], lambda x: torch.cat([x, seen["max"]]))
    lp, roll, m = procs[0]
    _log_mismatch(tr, "train", rollout_mismatch(lp, roll, m), m.sum().float())
    want = fam.rollout_mismatch(*(torch.cat([p[i] for p in procs]).double() for i in (0, 1)),
                                torch.cat([p[2] for p in procs]))
    assert 0 < float(want["rollout_nan_frac"]) < 1
    assert float(rollout_mismatch(*procs[0])["rollout_max_abs_diff"]) != float(want["rollout_max_abs_diff"])
    for k, v in want.items():
        assert tr._metrics["train"][f"gtpo/{k}"] == [pytest.approx(float(v), rel=1e-5)], k
