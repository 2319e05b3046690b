"""The TRL adapter over the sampler's distribution (spec 13): GRPOConfig's temperature, top_k, top_p and
min_p reach every log-prob pass (old policy, reference, the loss), and a rollout's recorded kept sets
(`sampling_mask`) travel with their rows through TRL's shuffle and split. Through TRL's own code path
(`_generate_and_score_completions` with transformers' generate or a rollout_func), tiny models on the
CPU (trl_setup.py); the oracles are float64: transformers' own warpers (the distribution the generator
sampled from) and gtpo_reference.gtpo_sampling. Skipped without TRL."""
import types

import pytest
import torch

import gtpo_kernels
from trl_setup import _trl_setup, needs_trl, tiny_model, tiny_tokenizer
from trl_setup import _one_torch_thread  # noqa: F401 (fixture)

F64 = torch.float64
PROMPTS = [{"prompt": p} for p in ["1+2=", "3+4="] for _ in range(4)]
# the sampler's settings: transformers' generate applies them in its order (temperature, top-k, top-p,
# min-p); min-p together with top-p is refused there (test_sampler_settings_refusals)
CASES = {"top_p": dict(top_p=0.8), "top_k": dict(top_k=12), "top_k_top_p": dict(top_k=20, top_p=0.9),
         "top_k_min_p": dict(top_k=25, min_p=0.7)}
TAU = 0.7


def _trainer(tmp_path, head, **sampler):
    """A GTPOTrainer (TRL's loss, GTPO's parts off) whose generation batch holds two micro-batches, so TRL
    computes old-policy log-probs, and with a reference model (beta > 0) other than the policy."""
    from gtpo_kernels.integrations.trl import GTPOTrainer, GTPOTrainerConfig
    tr = _trl_setup(tmp_path, GTPOTrainer, GTPOTrainerConfig, gtpo_head=head, gtpo_loss=None, temperature=TAU,
                    steps_per_generation=2, bf16=False, **sampler)
    tr.ref_model = tiny_model(len(tiny_tokenizer()), seed=7)
    from gtpo_kernels.integrations.trl_forward import _add_gtpo_head
    _add_gtpo_head(tr.ref_model)
    tr.args.beta = tr.beta = 0.1
    tr._gtpo_setup()
    tr.current_gradient_accumulation_steps = 1
    return tr


def _logits(model, batch):
    """The model's float32 logits of the T + 1 positions before and at the completion (row t predicts
    completion token t)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    am = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    T = batch["completion_ids"].size(1)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=am, logits_to_keep=T + 1).logits


def _generator_logps(logits, ids, mask, gen_kw, restore=False):
    """Float64 oracle: log-probs and entropies of the distribution transformers' generate sampled from,
    with transformers' own warpers built from the settings TRL hands it (trainer.generation_kwargs).
    restore: the sampled token is added back where the warpers removed it (spec 13: a reference model's
    own rebuilt sets need not hold the policy's samples); else every sampled token must be kept.
    Returns (logp, entropy, kept-set sizes, the number of tokens restored)."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    warpers = [TemperatureLogitsWarper(gen_kw["temperature"])]
    if gen_kw.get("top_k"):
        warpers.append(TopKLogitsWarper(gen_kw["top_k"]))
    if gen_kw.get("top_p") is not None and gen_kw["top_p"] < 1:
        warpers.append(TopPLogitsWarper(gen_kw["top_p"]))
    if gen_kw.get("min_p") is not None:
        warpers.append(MinPLogitsWarper(gen_kw["min_p"]))
    T, V = ids.size(1), logits.size(-1)
    s = logits[:, :T].to(F64).reshape(-1, V)
    tempered = s / gen_kw["temperature"]
    for w in warpers:
        s = w(None, s)
    y = ids.reshape(-1, 1)
    m = mask.bool()
    out = ~torch.isfinite(s.gather(-1, y))[:, 0] & m.reshape(-1)
    if restore:
        s = s.scatter(-1, y, torch.where(out[:, None], tempered.gather(-1, y), s.gather(-1, y)))
    else:
        assert not out.any(), "a sampled token outside the generator's own kept set"
    logp_all = torch.log_softmax(s, -1)
    p = logp_all.exp()
    ent = -(p * torch.where(p > 0, logp_all, torch.zeros_like(logp_all))).sum(-1).reshape(ids.shape)
    lp = logp_all.gather(-1, y).reshape(ids.shape)
    zero = torch.zeros((), dtype=F64)
    return (torch.where(m, lp, zero), torch.where(m, ent, zero), s.isfinite().sum(-1).reshape(ids.shape),
            int(out.sum()))


def _rel(x, ref, m):
    return float(((x.to(F64) - ref.to(F64)).abs() / ref.to(F64).abs().clamp(min=1.0))[m.bool()].max())


def _spy(monkeypatch):
    """Counts the adapter's calls of each entry point (in its head module), with the kept-set keywords."""
    from gtpo_kernels.integrations import trl_head
    calls = {}
    for name in ("gtpo_loss", "token_logprobs", "linear_gtpo_loss", "linear_token_logprobs"):
        def wrapped(*a, _name=name, _orig=getattr(trl_head, name), **k):
            if any(k.get(x) is not None for x in ("sampling_mask", "top_k", "top_p", "min_p")):
                calls[_name] = calls.get(_name, 0) + 1
            return _orig(*a, **k)
        monkeypatch.setattr(trl_head, name, wrapped)
    return calls


def _check_passes_and_loss(tr, case):
    """One generation batch through TRL's _generate_and_score_completions: its old-policy and reference
    log-probs are over the generator's kept sets (float64 oracle: transformers' warpers), differ from the
    whole vocabulary's, and the loss (and its gradients) equal gtpo_loss with the same keywords on the
    model's logits, and differ from the whole vocabulary's. Returns the measured differences."""
    sampler = CASES[case]
    torch.manual_seed(0)
    tr.model.train()
    batch = tr._generate_and_score_completions(PROMPTS)
    ids, m = batch["completion_ids"], batch["completion_mask"]
    assert m.sum() >= 20, "degenerate batch"
    out = {}
    for name, model, key in (("old", tr.model, "old_per_token_logps"), ("ref", tr.ref_model, "ref_per_token_logps")):
        logits = _logits(model, batch)
        lp_gen, ent_gen, kept, out[name + "_restored"] = _generator_logps(logits, ids, m, tr.generation_kwargs,
                                                                          restore=name == "ref")
        assert (kept[m.bool()] < logits.size(-1)).all(), "a rule that keeps every token: the case tests nothing"
        out[name] = _rel(batch[key], lp_gen, m)
        assert out[name] <= 1e-5, (name, out[name])
        # float64 oracle of spec 13 (vLLM's order, which equals transformers' for these settings)
        from gtpo_reference import gtpo_sampling as rs
        lp_r, ent_r, _, _ = rs.replay_token_logprobs(logits[:, :-1].to(F64), ids, m, temperature=TAU, **sampler)
        assert _rel(batch[key], lp_r, m) <= 1e-5
        # the pass's entropies too (TRL asks for them when it needs them: through the same method)
        am = torch.cat([batch["prompt_mask"], m], 1)
        with torch.no_grad():
            lp2, ent2, _ = tr._get_per_token_logps_and_entropies(
                model, torch.cat([batch["prompt_ids"], ids], 1), am, ids.size(1), batch_size=3, compute_entropy=True)
        out[name + "_entropy"] = _rel(ent2, ent_gen, m)
        assert out[name + "_entropy"] <= 1e-5 and _rel(lp2, lp_gen, m) <= 1e-5
        # ... and not the whole vocabulary's (the mapping is what makes them equal)
        full, _ = gtpo_kernels.token_logprobs(logits, ids, TAU, m, logits_start=0)
        out[name + "_vs_full"] = float((batch[key] - full)[m.bool()].abs().max())
        assert out[name + "_vs_full"] > 1e-2
    # the loss: gtpo_loss with the same keywords on the model's logits, value and gradients
    tr.model.zero_grad(set_to_none=True)
    loss = tr._compute_loss(tr.model, batch)
    loss.backward()
    grads = [p.grad.clone() for p in tr.model.parameters() if p.grad is not None]
    tr.model.zero_grad(set_to_none=True)
    pids = torch.cat([batch["prompt_ids"], ids], 1)
    am = torch.cat([batch["prompt_mask"], m], 1)
    logits = tr.model(input_ids=pids, attention_mask=am, logits_to_keep=ids.size(1) + 1).logits
    kw = dict(old_logps=batch["old_per_token_logps"], ref_logps=batch["ref_per_token_logps"], config=tr.gtpo_config,
              logits_start=0)
    want = gtpo_kernels.gtpo_loss(logits, ids, batch["advantages"], m, **kw, **sampler)
    want.loss.backward()
    grads_want = [p.grad.clone() for p in tr.model.parameters() if p.grad is not None]
    out["loss"] = abs(float(loss.detach()) - float(want.loss.detach())) / max(1.0, abs(float(want.loss.detach())))
    assert out["loss"] <= 1e-6, (float(loss), float(want.loss))
    num = sum(float((a - b).norm() ** 2) for a, b in zip(grads, grads_want)) ** 0.5
    den = sum(float(b.norm() ** 2) for b in grads_want) ** 0.5
    out["grad"] = num / den
    assert len(grads) == len(grads_want) and out["grad"] <= 1e-5, out
    with torch.no_grad():
        full = gtpo_kernels.gtpo_loss(logits, ids, batch["advantages"], m, **kw)
    out["loss_vs_full"] = abs(float(full.loss) - float(want.loss.detach()))
    assert out["loss_vs_full"] > 1e-4, out
    tr.model.zero_grad(set_to_none=True)
    return out


@needs_trl
@pytest.mark.parametrize("case", list(CASES))
def test_trl_logits_head_replays_the_generator_sets(tmp_path, monkeypatch, case):
    """gtpo_head='logits': every pass over the generator's kept sets (see _check_passes_and_loss)."""
    tr = _trainer(tmp_path, "logits", **CASES[case])
    assert tr.gtpo_replay == CASES[case]
    calls = _spy(monkeypatch)
    _check_passes_and_loss(tr, case)
    # old + reference passes (TRL's chunks of 4 rows, then of 3 rows for the entropies), the loss
    assert calls == {"token_logprobs": 2 * 2 + 3 + 3, "gtpo_loss": 1}, calls


def _head_replays():
    """Whether linear_token_logprobs takes the kept-set keywords (the fused head's replay): the reason to
    skip if not."""
    h = torch.randn(1, 2, 4)
    w = torch.randn(5, 4)
    try:
        gtpo_kernels.linear_token_logprobs(h, w, torch.tensor([[0, 1]]), 1.0, top_k=2)
    except ValueError as e:
        if "does not replay" in str(e):
            return str(e)
        raise
    except TypeError as e:
        if "unexpected keyword" in str(e):
            return str(e)
        raise
    return None


@needs_trl
@pytest.mark.parametrize("case", ["top_k_top_p", "top_k_min_p"])
def test_trl_fused_head_replays_the_generator_sets(tmp_path, monkeypatch, case):
    """The default fused head: the same passes and loss through linear_token_logprobs / linear_gtpo_loss,
    once the head replays kept sets (skipped, with the head's own refusal as the reason, until then; the
    adapter then raises saying to use gtpo_head='logits')."""
    reason = _head_replays()
    tr = _trainer(tmp_path, "fused", **CASES[case])
    if reason is not None:
        torch.manual_seed(0)
        with pytest.raises(NotImplementedError, match="gtpo_head='logits'"):
            tr._generate_and_score_completions(PROMPTS)
        pytest.skip(f"the fused LM head does not replay kept sets yet: {reason}")
    calls = _spy(monkeypatch)
    _check_passes_and_loss(tr, case)
    assert calls == {"linear_token_logprobs": 2 * 2 + 3 + 3, "linear_gtpo_loss": 1}, calls


@needs_trl
def test_sampler_settings_map_trl_fields(tmp_path):
    """GRPOConfig's fields (and generation_kwargs' overrides) -> the replay keywords; off values -> None;
    the config's temperature is the sampler's."""
    from trl import GRPOConfig
    from gtpo_kernels.integrations.trl import GTPOTrainerConfig, gtpo_config_from_args, sampler_settings

    def args(**kw):
        return GTPOTrainerConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)

    off = dict(temperature=1.0, top_k=None, top_p=None, min_p=None)
    assert sampler_settings(GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True)) == off  # TRL's defaults
    for kw in (dict(top_k=0), dict(top_k=-1), dict(top_p=1.0), dict(min_p=0.0), dict(min_p=None)):
        assert sampler_settings(args(**kw)) == off, kw
    assert sampler_settings(args(temperature=0.6, top_k=50, top_p=0.95, min_p=0.05)) == \
        dict(temperature=0.6, top_k=50, top_p=0.95, min_p=0.05)
    # generation_kwargs overrides the fields (TRL passes it last to vLLM's SamplingParams and to generate)
    a = args(temperature=0.6, top_p=0.95, generation_kwargs={"top_p": 0.7, "top_k": 8, "temperature": 0.9})
    assert sampler_settings(a) == dict(temperature=0.9, top_k=8, top_p=0.7, min_p=None)
    assert gtpo_config_from_args(a).temperature == 0.9
    for kw, match in [(dict(top_k=-2), r"GRPOConfig\.top_k"), (dict(top_p=0.0), r"GRPOConfig\.top_p"),
                      (dict(top_p=1.5), r"GRPOConfig\.top_p"), (dict(min_p=1.5), r"GRPOConfig\.min_p"),
                      (dict(generation_kwargs={"top_k": 2.5}), r"generation_kwargs\['top_k'\]"),
                      (dict(top_k=float("inf")), r"GRPOConfig\.top_k"),
                      (dict(top_k=float("nan")), r"GRPOConfig\.top_k"),
                      (dict(generation_kwargs={"top_k": float("inf")}), r"generation_kwargs\['top_k'\]"),
                      (dict(temperature=0.0), r"GRPOConfig\.temperature"),
                      (dict(temperature=float("inf")), r"GRPOConfig\.temperature")]:
        with pytest.raises(ValueError, match=match):
            sampler_settings(types.SimpleNamespace(**{**off, **kw}))


@needs_trl
def test_sampler_settings_refusals(tmp_path):
    """min_p with top_p < 1 under transformers' generate (min-p applied last there, first in vLLM's order,
    which the replay follows) is refused naming both; with use_vllm the same settings pass. A pass TRL would
    make over the whole vocabulary (with a gradient) is refused while kept sets are on."""
    from gtpo_kernels.integrations.trl import GTPOTrainer, GTPOTrainerConfig
    from gtpo_kernels.integrations.trl_sampler import _sampler_refusals
    with pytest.raises(ValueError, match="min_p together with top_p"):
        _trl_setup(tmp_path, GTPOTrainer, GTPOTrainerConfig, top_p=0.9, min_p=0.1)
    assert _sampler_refusals(types.SimpleNamespace(temperature=1.0, top_k=0, top_p=0.9, min_p=0.1, use_vllm=True)) == []
    tr = _trl_setup(tmp_path, GTPOTrainer, GTPOTrainerConfig, top_p=0.9)
    ids = torch.randint(3, 40, (2, 6))
    with pytest.raises(NotImplementedError, match="over the whole"):
        tr._get_per_token_logps_and_entropies(tr.model, ids, torch.ones_like(ids), 3)


# ------------------------------------------------------------------ recorded kept sets (sampling_mask)

def _rollout_with_sets(V, seed=0):
    """A rollout_func (TRL's extension point) returning random completions, an env_mask (tokens the model
    did not sample, out of the loss) and, per completion, random kept sets holding each sampled token."""
    tok = tiny_tokenizer()
    g = torch.Generator().manual_seed(seed)
    recorded = []

    def rollout(prompts, trainer):
        prompt_ids = [tok(p if isinstance(p, str) else p["prompt"])["input_ids"] for p in prompts]
        comp, logps, env, sets = [], [], [], []
        for _ in prompts:
            n = int(torch.randint(3, 9, (1,), generator=g))
            ids = torch.randint(3, V, (n,), generator=g)
            env_row = (torch.rand(n, generator=g) > 0.2).long()
            env_row[0] = 1
            tid, off = [], [0]
            for y in ids.tolist():
                k = int(torch.randint(1, V // 2, (1,), generator=g))
                s = torch.randperm(V, generator=g)[:k]
                s = torch.cat([s[s != y], torch.tensor([y])])
                s = s[torch.randperm(s.numel(), generator=g)]  # the sampled token anywhere in its set
                tid.append(s)
                off.append(off[-1] + s.numel())
            comp.append(ids.tolist())
            logps.append([-1.0] * n)
            env.append(env_row.tolist())
            sets.append((torch.cat(tid), torch.tensor(off)))
        recorded.append((comp, sets, env))
        return {"prompt_ids": prompt_ids, "completion_ids": comp, "logprobs": logps, "env_mask": env,
                "sampling_mask": sets}
    return rollout, recorded


def _flat(sets_rows, counted_rows):
    """The test's own flattening: the sets of the counted tokens, row-major (gtpo_loss's order)."""
    tid, off = [], [0]
    for (t, o), c in zip(sets_rows, counted_rows):
        for j, keep in enumerate(c):
            if keep:
                s = t[int(o[j]):int(o[j + 1])]
                tid.append(s)
                off.append(off[-1] + s.numel())
    return (torch.cat(tid) if tid else torch.zeros(0, dtype=torch.long)), torch.tensor(off)


def _recorded_batch(tmp_path, head, rollout, **args):
    """(GTPOTrainer with `head` and the rollout_func `rollout`, one generation batch of PROMPTS through TRL's
    _generate_and_score_completions, in train mode)."""
    from gtpo_kernels.integrations.trl import GTPOTrainer, GTPOTrainerConfig
    tr = _trl_setup(tmp_path, GTPOTrainer, GTPOTrainerConfig, gtpo_head=head, gtpo_loss=None, temperature=TAU,
                    steps_per_generation=2, bf16=False, **args)
    tr.rollout_func = rollout
    tr.current_gradient_accumulation_steps = 1
    torch.manual_seed(0)
    tr.model.train()
    return tr, tr._generate_and_score_completions(PROMPTS)


@needs_trl
@pytest.mark.parametrize("head", ["logits", "fused"])
def test_trl_recorded_sampling_mask_through_shuffle_and_split(tmp_path, head):
    """A rollout_func's `sampling_mask` (one (token_ids, offsets) per completion): the old-policy pass is
    over those sets (float64 oracle: gtpo_reference.gtpo_sampling), the batch carries them as a list that
    TRL's shuffle and split move with their rows, and each micro-batch's loss equals gtpo_loss with the
    micro-batch's sets of the counted tokens (env_mask's tokens left out), and not the whole vocabulary's."""
    from gtpo_reference import gtpo_sampling as rs
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict
    if head == "fused" and _head_replays() is not None:
        pytest.skip(f"the fused LM head does not replay kept sets yet: {_head_replays()}")
    V = len(tiny_tokenizer())
    rollout, recorded = _rollout_with_sets(V)
    tr, batch = _recorded_batch(tmp_path, head, rollout, top_p=0.9)  # (top_p: the rules the recorded sets replace)
    comp, sets, env = recorded[-1]
    assert isinstance(batch["sampling_mask"], list) and len(batch["sampling_mask"]) == len(comp)
    ids, m = batch["completion_ids"], batch["completion_mask"]
    assert torch.equal(batch["tool_mask"][m.bool()], torch.tensor([x for r in env for x in r]))
    logits = _logits(tr.model, batch)
    flat_all = _flat(sets, [[1] * len(r) for r in comp])
    lp_r, _, _, _ = rs.replay_token_logprobs(logits[:, :-1].to(F64), ids, m, temperature=TAU, sampling_mask=flat_all)
    d_old = _rel(batch["old_per_token_logps"], lp_r, m)
    assert d_old <= 1e-5, d_old
    full, _ = gtpo_kernels.token_logprobs(logits, ids, TAU, m, logits_start=0)
    assert float((batch["old_per_token_logps"] - full)[m.bool()].abs().max()) > 1e-1
    # TRL's shuffle and split, then each micro-batch's loss
    torch.manual_seed(3)
    parts = split_tensor_dict(shuffle_sequence_dict(batch), 2)
    order = []
    for part in parts:
        rows = [next(i for i, s in enumerate(sets) if s is r) for r in part["sampling_mask"]]
        order += rows
        assert all(torch.equal(part["completion_ids"][j, :len(comp[i])], torch.tensor(comp[i]))
                   for j, i in enumerate(rows)), "the sets left their rows"
        cm = part["completion_mask"] * part["tool_mask"]
        flat = _flat([sets[i] for i in rows], [env[i] for i in rows])
        assert flat[1][-1] < sum(int(sets[i][1][-1]) for i in rows)  # env_mask did drop sets
        with torch.no_grad():
            loss = tr._compute_loss(tr.model, part)
        pl = _logits(tr.model, part)
        kw = dict(old_logps=part["old_per_token_logps"], config=tr.gtpo_config, logits_start=0)
        want = gtpo_kernels.gtpo_loss(pl, part["completion_ids"], part["advantages"], cm, sampling_mask=flat, **kw)
        nofull = gtpo_kernels.gtpo_loss(pl, part["completion_ids"], part["advantages"], cm, **kw)
        d_loss = abs(float(loss) - float(want.loss)) / max(1.0, abs(float(want.loss)))
        assert d_loss <= 1e-6, (float(loss), float(want.loss))
        assert abs(float(nofull.loss) - float(want.loss)) > 1e-4
    assert sorted(order) == list(range(len(comp))) and order != sorted(order)  # shuffled, all rows once


@needs_trl
@pytest.mark.parametrize("head", ["logits", "fused"])
def test_trl_recorded_sampling_mask_with_truncated_completions_masked(tmp_path, head):
    """mask_truncated_completions=True: TRL zeroes a truncated completion's completion_mask after the rollout
    recorded a set per generated token; the sets still line up with the tokens (a masked-out completion's are
    not used): old-policy log-probs over the recorded sets (float64 oracle) and each loss = gtpo_loss with the
    counted tokens' sets."""
    from gtpo_kernels.integrations.trl_sampler import _flat_sampling_mask
    from gtpo_reference import gtpo_sampling as rs
    if head == "fused" and _head_replays() is not None:
        pytest.skip(f"the fused LM head does not replay kept sets yet: {_head_replays()}")
    V = len(tiny_tokenizer())
    rollout, recorded = _rollout_with_sets(V, seed=1)

    def ending(prompts, trainer):  # the even completions end with EOS (id 1); the odd ones are truncated
        out = rollout(prompts, trainer)
        for i in range(0, len(out["completion_ids"]), 2):
            t, o = out["sampling_mask"][i]
            out["completion_ids"][i][-1] = 1
            out["sampling_mask"][i] = (torch.cat([t[:int(o[-2])], torch.tensor([1, 4])]),
                                        torch.cat([o[:-1], o[-2:-1] + 2]))
        return out
    tr, batch = _recorded_batch(tmp_path, head, ending, mask_truncated_completions=True)
    comp, sets, env = recorded[-1]
    ids, m = batch["completion_ids"], batch["completion_mask"]
    assert m[1::2].sum() == 0 and all(int(r.sum()) == len(c) for r, c in zip(m[::2], comp[::2]))
    logits = _logits(tr.model, batch)
    flat = _flat(sets, [[int(i % 2 == 0)] * len(c) for i, c in enumerate(comp)])
    lp_r, _, _, _ = rs.replay_token_logprobs(logits[:, :-1].to(F64), ids, m, temperature=TAU, sampling_mask=flat)
    assert _rel(batch["old_per_token_logps"], lp_r, m) <= 1e-5
    cm = m * batch["tool_mask"]
    got = _flat_sampling_mask(batch["sampling_mask"], m, cm)
    want = _flat(sets, [[e * int(i % 2 == 0) for e in env[i]] for i in range(len(comp))])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with torch.no_grad():
        loss = tr._compute_loss(tr.model, batch)
    kw = dict(old_logps=batch["old_per_token_logps"], config=tr.gtpo_config, logits_start=0)
    ref = gtpo_kernels.gtpo_loss(logits, ids, batch["advantages"], cm, sampling_mask=want, **kw)
    assert abs(float(loss) - float(ref.loss)) <= 1e-6 * max(1.0, abs(float(ref.loss)))


@needs_trl
def test_trl_sampling_mask_refusals(tmp_path):
    """A batch's sampling_mask with the wrong number of completions or of sets is refused naming it."""
    from gtpo_kernels.integrations.trl_sampler import _flat_sampling_mask
    cm = torch.tensor([[1, 1, 0], [1, 0, 0]])
    good = [(torch.tensor([4, 5, 6]), torch.tensor([0, 2, 3])), (torch.tensor([7]), torch.tensor([0, 1]))]
    t, o = _flat_sampling_mask(good, cm, cm * torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert t.tolist() == [6, 7] and o.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match=r"one \(token_ids, offsets\) per completion \(2\), got 1"):
        _flat_sampling_mask(good[:1], cm, cm)
    with pytest.raises(ValueError, match=r"sampling_mask\[1\]: offsets has 3 entries .* 1 tokens"):
        _flat_sampling_mask([good[0], (torch.tensor([7, 8]), torch.tensor([0, 1, 2]))], cm, cm)
    with pytest.raises(ValueError, match=r"sampling_mask\[0\] must be a pair"):
        _flat_sampling_mask([(torch.tensor([4.0]), torch.tensor([0, 1, 1])), good[1]], cm, cm)
    with pytest.raises(ValueError, match="non-decreasing"):
        _flat_sampling_mask([(torch.tensor([4, 5, 6]), torch.tensor([0, 2, 1])), good[1]], cm, cm)
    # set j is position j's: a token masked out inside a completion, or a whole completion (TRL's
    # mask_truncated_completions), leaves its set unused; a masked-out one holds at most a set per position
    gap = torch.tensor([[1, 0, 1], [0, 0, 0]])
    three = (torch.tensor([4, 5, 6]), torch.tensor([0, 1, 2, 3]))
    t, o = _flat_sampling_mask([three, three], gap, gap)
    assert t.tolist() == [4, 6] and o.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match=r"sampling_mask\[1\]: offsets has 5 entries for a completion masked out"):
        _flat_sampling_mask([three, (torch.arange(4), torch.arange(5))], gap, gap)


@needs_trl
@pytest.mark.parametrize("sampler", [{}, dict(top_k=12), "recorded"])
def test_trl_logs_the_replay_metrics(tmp_path, monkeypatch, sampler):
    """Spec 13's metrics of a loss call that replays kept sets (the sampler's rules: kept_mass,
    mean_kept_size, replay_restored_frac; a rollout's recorded sets: no kept_mass) are logged under gtpo/,
    equal (one process) to the loss's own out.metrics; without kept sets none is logged. The default
    fused head."""
    if _head_replays() is not None:
        pytest.skip(f"the fused LM head does not replay kept sets yet: {_head_replays()}")
    from gtpo_kernels.integrations.trl_metrics import REPLAY_METRICS
    if sampler == "recorded":
        from gtpo_kernels.integrations.trl import GTPOTrainer, GTPOTrainerConfig
        tr = _trl_setup(tmp_path, GTPOTrainer, GTPOTrainerConfig, gtpo_loss=None, temperature=TAU,
                        steps_per_generation=2, bf16=False)
        tr.rollout_func = _rollout_with_sets(len(tiny_tokenizer()))[0]
        tr.current_gradient_accumulation_steps = 1
        want_keys = {"mean_kept_size", "replay_restored_frac"}
    else:
        tr = _trainer(tmp_path, "fused", **sampler)
        want_keys = set(REPLAY_METRICS) if sampler else set()
    torch.manual_seed(0)
    tr.model.train()
    batch = tr._generate_and_score_completions(PROMPTS)
    seen = {}
    orig = tr._gtpo_log
    monkeypatch.setattr(tr, "_gtpo_log", lambda mode, out, *a: (seen.update(out=out), orig(mode, out, *a))[1])
    logged = tr._metrics["train"]
    before = {k: len(logged[k]) for k in logged}
    with torch.no_grad():
        tr._compute_loss(tr.model, batch)
    met = seen["out"].metrics
    assert {k for k in REPLAY_METRICS if k in met} == want_keys, sorted(met)
    for k in REPLAY_METRICS:
        new = logged.get(f"gtpo/{k}", [])[before.get(f"gtpo/{k}", 0):]
        if k in want_keys:
            assert new == [pytest.approx(float(met[k]), rel=1e-6, abs=1e-9)], (k, new, float(met[k]))
        else:
            assert new == [], (k, new)
    if sampler:
        assert float(met["mean_kept_size"]) > 1  # a replay that keeps more than the sampled token


def test_replay_metrics_aggregate_over_processes():
    """Across processes each of spec 13's metrics is a mean over all counted tokens: each process's mean
    weighted by its counted tokens (a fake accelerator summing this process's stats with another's)."""
    from collections import defaultdict

    from gtpo_kernels.integrations.trl_metrics import _log_replay
    t = lambda x: torch.tensor(x)  # noqa: E731
    other = {"kept_mass": t(0.5), "mean_kept_size": t(3.0), "replay_restored_frac": t(0.25)}, t(30.0)
    mine = {"kept_mass": t(0.9), "mean_kept_size": t(7.0), "replay_restored_frac": t(0.0)}, t(10.0)

    def reduce(stats, reduction):
        assert reduction == "sum"
        return stats + torch.stack([other[0][k] * other[1] for k in mine[0]] + [other[1]])
    tr = types.SimpleNamespace(accelerator=types.SimpleNamespace(reduce=reduce), _metrics={"train": defaultdict(list)})
    _log_replay(tr, "train", *mine)
    got = {k: v for k, v in tr._metrics["train"].items()}
    assert got == {f"gtpo/{k}": [pytest.approx((float(mine[0][k]) * 10 + float(other[0][k]) * 30) / 40)]
                   for k in mine[0]}, got
    tr._metrics["train"].clear()
    _log_replay(tr, "train", {"clip_frac": t(0.1)}, t(10.0))  # no kept sets: nothing, no collective
    assert not tr._metrics["train"]


@needs_trl
def test_trl_logits_head_passes_at_generation_kwargs_temperature(tmp_path):
    """gtpo_head='logits' with generation_kwargs={'temperature': 0.5} over GRPOConfig.temperature 1.0: the loss
    divides by 0.5 (the sampler's), so the old-policy and reference passes must too. They fell back to TRL's
    own pass, at 1.0: on the first step (policy = old = ref) the ratio was not 1 (|logp - old| 0.29), the KL
    6.8e-3, the loss 2.8e-3. Now as the fused head: ratio 1, KL 0, loss 0."""
    from gtpo_kernels.integrations.trl import GTPOTrainer, GTPOTrainerConfig
    mdir = tmp_path / "model"
    tiny_model(len(tiny_tokenizer()), seed=1).save_pretrained(mdir)  # (a path: TRL builds the ref model, beta > 0)
    for head in ("logits", "fused"):
        tr = _trl_setup(tmp_path / head, GTPOTrainer, GTPOTrainerConfig, model=str(mdir), gtpo_loss=None,
                        gtpo_head=head, bf16=False, temperature=1.0, generation_kwargs={"temperature": 0.5},
                        beta=0.1, num_iterations=2, gradient_accumulation_steps=1, steps_per_generation=1)
        tr.model.train()
        torch.manual_seed(0)
        batch = tr._generate_and_score_completions([{"prompt": p} for p in ["1+2=", "3+4="] for _ in range(4)])
        seen = {}
        log = tr._gtpo_log
        tr._gtpo_log = lambda mode, out, *a: (seen.update(out=out), log(mode, out, *a))[1]
        tr.current_gradient_accumulation_steps = 1
        with torch.no_grad():
            loss = tr._compute_loss(tr.model, batch)
        m = batch["completion_mask"].bool()
        cur = seen["out"].logps
        for name in ("old_per_token_logps", "ref_per_token_logps"):
            assert (cur - batch[name])[m].abs().max() < 1e-5, (head, name)
        assert abs(loss.item()) < 1e-6 and tr._metrics["train"]["kl"][-1] < 1e-6, (head, loss.item())
