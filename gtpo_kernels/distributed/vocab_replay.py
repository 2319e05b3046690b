"""The sampler's kept sets across a vocabulary split (spec 12 and 13).

Each rank reads only the kept logits of its slice: for counted token m with kept set K_m, the ids of K_m
in [start, start + V_r). With s = z' / tau_m on them and the per-token statistics

    M_m = max over the set                      (all-reduce MAX of each rank's maximum, no gradient)
    S_m = sum exp(s - M_m),  A_m = sum exp(s - M_m) (s - M_m),  t_m = s_y - M_m (from y's owner)
                                                (all-reduce SUM of 3 numbers a token, and a flag)

logp = t - log S and H = log S - A / S, as on one process; the merge moves O(M) bytes whatever the sets'
sizes. The loss being identical on every rank, each rank differentiates its own S_m, A_m, t_m: the
all-reduce's backward is the identity (no communication), and each slice's gradient is its part of the
single-process gradient, exactly 0 outside the kept sets.

Rebuilt sets need `top_k` on every token: each rank's top_k candidates (values and global ids) are
gathered, and vLLM's rules run on them (min-p's maximum, the k-th largest value and what top-p
renormalizes are all among them), then the sampled token is restored. Exact ties at the k-th value split
across ranks can hide a tied entry: such tokens are refused when validating (NaN when not).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..core import checks
from ..core.flags import BAD_NONFINITE, BAD_TARGET_NEG_INF, NonFiniteRowError
from ..core.sampling import check_sampling_mask, segment_of
from ..kernels import replay as rp
from ..kernels.kept_set import _block, _param, rows_per_block
from ..kernels.vocab_torch import _transform


class _Sum(torch.autograd.Function):
    """all_reduce(SUM) whose backward is the identity: every rank holds the same loss of the sum."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


def _values(logits3, rows_b, rows_t, cols, scale, softcap, tau):
    """s of the entries (rows_b, rows_t, cols) of this slice, differentiable (a gather: its gradient is 0
    at every other logit)."""
    z = logits3[rows_b, rows_t, cols]
    acc = torch.float64 if z.dtype == torch.float64 else torch.float32
    z = z.to(acc)
    if scale != 1.0:
        z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / tau


def _tau_at(tau, seg, device):
    """tau (per token (M,), or a number) at each set entry of `seg`, as _values takes it."""
    return tau if not isinstance(tau, torch.Tensor) else tau.to(device)[seg]


def merge(logits3, rows_b, rows_t, y, tau, token_ids, offsets, vp, scale=1.0, softcap=None):
    """(logp, H, flags, LSE over the set) (M,) of the counted tokens over their kept sets (global ids),
    merged over the group; rows_b, rows_t, y (M,); tau a number or (M,) tensor."""
    M, K = offsets.numel() - 1, token_ids.numel()
    dev = logits3.device
    V_r = logits3.shape[-1]
    acc = torch.float64 if logits3.dtype == torch.float64 else torch.float32
    if M == 0:
        e = torch.zeros(0, dtype=acc, device=dev)
        return e, e, e.to(torch.int8), e
    seg = segment_of(offsets, K)
    mine = (token_ids >= vp.start) & (token_ids < vp.start + V_r)
    tid, seg = token_ids[mine], seg[mine]  # (sync: this slice's share of the sets)
    cols = tid - vp.start
    tau_k = _tau_at(tau, seg, dev)
    s = _values(logits3, rows_b[seg], rows_t[seg], cols, scale, softcap, tau_k)
    ninf = torch.full((M,), float("-inf"), dtype=acc, device=dev)
    finite = torch.isfinite(s.detach())
    mx = ninf.scatter_reduce(0, seg, torch.where(finite, s.detach(), torch.full_like(s, float("-inf"))), "amax")
    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=vp.group)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    e = torch.exp(s - mx[seg])
    zero = torch.zeros(M, dtype=acc, device=dev)
    S_r = zero.index_add(0, seg, e)
    A_r = zero.index_add(0, seg, torch.where(e > 0, e * (s - mx[seg]), torch.zeros_like(e)))
    # t = s_y - M read at the sampled id's own set entry (a valid set holds it; else its token is NaN): one gather
    # of the logits, so the gradient at y (1 - p_y, small where the token is confident) is summed in float32
    # before its cast to a 16-bit logits' dtype, not rounded twice (once per gather) and then summed
    hit = tid == y.long()[seg]
    t_r = zero.index_add(0, seg, torch.where(hit, s - mx[seg], torch.zeros_like(s)))
    bad_r = zero.index_add(0, seg, (~finite & ~(s.detach() == float("-inf"))).to(acc))  # NaN or +inf in a set
    S, A, t, bad = _Sum.apply(torch.stack([S_r, A_r, t_r, bad_r.detach()]), vp.group)
    log_s = torch.log(S)
    logp = t - log_s
    ent = log_s - A / S
    empty = (logp.detach() == float("-inf")) | (S.detach() == 0)  # the sampled token, or the whole set, at -inf
    flags = torch.where(bad > 0, BAD_NONFINITE, 0) | torch.where(empty, BAD_TARGET_NEG_INF, 0)
    return logp, ent, flags.to(torch.int8), (mx + log_s).detach()


def merge_grad(logits3, rows_b, rows_t, y, tau, token_ids, offsets, vp, lse, ent, g_logp, g_ent, scale=1.0,
               softcap=None):
    """dL/dlogits3 of this slice for merge's logp and H, from the forward's merged LSE over each set and H
    (M,) (not finite where the forward flagged the token or it was invalid: no gradient there) and the
    upstream gradients g_logp, g_ent (M,): with p_k = exp(s_k - LSE), d logp/ds_k = [k = y] - p_k and
    dH/ds_k = -p_k (s_k - LSE + H) at this slice's entries. Everything global came from the forward: the
    backward communicates nothing (spec 12), so a rank whose slice is frozen may skip it."""
    M, K = offsets.numel() - 1, token_ids.numel()
    V_r = logits3.shape[-1]
    if M == 0 or V_r == 0:
        return torch.zeros_like(logits3)
    ok = torch.isfinite(lse + ent)
    g_logp, g_ent = torch.where(ok, g_logp, 0.0), torch.where(ok, g_ent, 0.0)  # (a NaN upstream: kept, the caller's)
    seg, cols = segment_of(offsets, K), token_ids - vp.start
    mine = (cols >= 0) & (cols < V_r)  # (the others' entries at a column of this slice, their gradient 0: no sync)
    cols = cols.clamp(0, V_r - 1)
    tau_k = _tau_at(tau, seg, logits3.device)
    hit = token_ids == y.long()[seg]  # the sampled id's own entry: d logp / ds_y = 1 - p_y = -expm1(s_y - LSE)
    with torch.enable_grad():
        z = logits3.detach().requires_grad_()
        s = _values(z, rows_b[seg], rows_t[seg], cols, scale, softcap, tau_k)
        d = s.detach() - lse[seg]
        pk = torch.exp(d)
        g_h = -pk * g_ent[seg] * (d + ent[seg])
        gs = torch.where(hit, -torch.expm1(d) * g_logp[seg] + g_h, -pk * g_logp[seg] + g_h)
        gs = torch.where(mine & ok[seg] & ((pk > 0) | hit), gs, 0.0)  # (an entry at -inf: p_k = 0, no 0 * inf)
        gz, = torch.autograd.grad([s], [z], [gs])  # (one gather: y's two terms summed before a 16-bit cast)
    return gz


def rebuilt_sets(logits3, rows_b, rows_t, y, tau, top_k, top_p, min_p, vp, scale=1.0, softcap=None,
                 block_rows=None):
    """The kept sets of the counted tokens rebuilt by vLLM's rules from each rank's top_k candidates:
    (token_ids, offsets, restored, nonfinite or hidden ties (M,), log of the full softmax's normalizer (M,)). top_k: > 0 on every
    token (checked by the caller). Blocks sized by the largest slice: every rank makes the same
    collectives."""
    M, V_r, dev = y.numel(), logits3.shape[-1], logits3.device
    acc = torch.float64 if logits3.dtype == torch.float64 else torch.float32
    world = dist.get_world_size(vp.group)
    step = block_rows or rows_per_block(vp.V_max)
    k_all = _param(top_k, slice(0, M), 0, torch.long, dev)
    # sync: the candidates' width (a top_k of 0, unvalidated: NaN), at most the largest slice: a top_k above the
    # vocabulary keeps every entry, in the same buffers as a top_k of V (spec 13: the memory budget holds)
    kmax = min(max(int(k_all.max()), 1), max(vp.V_max, 1)) if M else 1
    ids, counts, restored, invalid, mass = [], [], [], [], []
    for r0 in range(0, M, step):
        sl = slice(r0, min(M, r0 + step))
        R = sl.stop - sl.start
        s = _transform(logits3[rows_b[sl], rows_t[sl]].to(acc), scale, softcap) * \
            (1.0 / _param(tau, sl, 1.0, acc, dev))[:, None]
        nf = (torch.isnan(s) | (s == float("inf"))).any(-1)
        s = torch.where(torch.isnan(s), torch.full_like(s, float("-inf")), s)
        w = min(kmax, V_r)
        vals, idx = torch.topk(s, w, dim=-1) if w else (s[:, :0], s[:, :0].long())
        cand = torch.full((R, kmax), float("-inf"), dtype=acc, device=dev)
        cid = torch.full((R, kmax), -1, dtype=torch.long, device=dev)
        cand[:, :w], cid[:, :w] = vals, idx + vp.start
        # the full softmax's normalizer, for kept_mass: each slice's max and sum, merged
        mx = s.max(-1).values if V_r else torch.full((R,), float("-inf"), dtype=acc, device=dev)
        gmx = mx.clone()
        dist.all_reduce(gmx, op=dist.ReduceOp.MAX, group=vp.group)
        gsafe = torch.where(torch.isfinite(gmx), gmx, torch.zeros_like(gmx))
        stats = torch.stack([torch.exp(s - gsafe[:, None]).sum(-1), nf.to(acc)], 1)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=vp.group)
        gv, gi = [torch.empty_like(cand) for _ in range(world)], [torch.empty_like(cid) for _ in range(world)]
        dist.all_gather(gv, cand, group=vp.group)
        dist.all_gather(gi, cid, group=vp.group)
        cv, ci = torch.cat(gv, 1), torch.cat(gi, 1)
        order = torch.sort(torch.where(ci < 0, torch.full_like(ci, 1 << 62), ci), dim=1, stable=True).indices
        cv, ci = cv.gather(1, order), ci.gather(1, order)  # ascending ids: top-p's tie rule
        k = k_all[sl].clamp(min=0, max=cv.shape[1])  # (every candidate of every rank: the whole vocabulary)
        tp = _param(top_p, sl, 1.0, acc, dev)
        tp = torch.where((tp > 0) & (tp <= 1), tp, torch.ones_like(tp))
        mp = _param(min_p, sl, 0.0, acc, dev)
        mp = torch.where((mp >= 0) & (mp <= 1), mp, torch.zeros_like(mp))
        keep = _block(cv, k, tp, mp)
        # a tie at the k-th value hidden beyond a slice's own candidates (vLLM keeps every tie)
        kth = torch.sort(cv, dim=1, descending=True).values.gather(1, (k.clamp(min=1) - 1)[:, None])
        extra = ((s >= kth).sum(-1) - (cand >= kth).sum(-1)).to(acc)
        dist.all_reduce(extra, op=dist.ReduceOp.SUM, group=vp.group)
        yc = y[sl].long()
        hit = (keep & (ci == yc[:, None])).any(1)
        keep = torch.cat([keep, ~hit[:, None]], 1)  # the sampled token restored where the rules left it out
        ci = torch.cat([ci, yc[:, None]], 1)
        nz = keep.nonzero()  # row-major: each token's set in turn
        ids.append(ci[nz[:, 0], nz[:, 1]])
        counts.append(keep.sum(1))
        restored.append(~hit)
        # a hidden tie matters only if the k-th value survives min-p (vLLM applies min-p after top-k: a tie
        # that min-p removes is no tie): min-p keeps s >= max s + log(min_p)
        survives = kth.squeeze(1) >= gmx + torch.log(mp)  # min_p = 0: log 0 = -inf, every value survives
        # unvalidated, a sampled id outside the whole vocabulary is no rank's: its token NaN (as on one process)
        invalid.append((stats[:, 1] > 0) | ((extra > 0) & survives) | (yc < 0) | (yc >= vp.V))
        lse_full = gsafe + torch.log(stats[:, 0])
        mass.append(lse_full)  # the full normalizer's log (kept_mass = exp(LSE_K - this))
    cat = lambda xs, dt: torch.cat(xs) if xs else torch.zeros(0, dtype=dt, device=dev)  # noqa: E731
    c = cat(counts, torch.long)
    offsets = torch.cat([c.new_zeros(1), torch.cumsum(c, 0)])
    return cat(ids, torch.long), offsets, cat(restored, torch.bool), cat(invalid, torch.bool), cat(mass, acc)


def missing_k(top_k, y, host, counted=None):
    """(M,) bool: the counted tokens without a top_k > 0 (refused when validating: identical on every rank);
    with `counted` (M,) bool, the tokens are the flat ones and only the counted count."""
    no_k = _param(top_k, slice(0, y.numel()), 0, torch.long, y.device) <= 0
    if counted is not None:
        no_k = no_k & counted
    if host and bool(no_k.any()):
        raise ValueError("top_k with process_group must be > 0 at every counted token (each rank's top_k "
                         "candidates are gathered to rebuild the sets); pass the sets the engine recorded as "
                         "sampling_mask to replay without top_k")
    return no_k


def refuse_unbuilt(invalid, host):
    """Validating, the rebuilt sets' invalid tokens raise (the same on every rank: merged flags)."""
    if host and bool(invalid.any()):
        raise NonFiniteRowError("top_k with process_group: exact ties at a token's top_k-th value are split across "
                         "ranks (or its logits hold NaN / +inf), so its kept set cannot be rebuilt from the "
                         "ranks' candidates; pass the sets the engine recorded as sampling_mask")


def replayed(b, tau, sampling_mask, rules, vp, host, scale=1.0, softcap=None):
    """gtpo_loss / token_logprobs on this rank's logits slice over the kept sets -> (logp, H, metrics),
    (n,) flat (0 where not counted, NaN where invalid), differentiable w.r.t. the slice."""
    pos = b.counted.reshape(-1).nonzero().squeeze(1)  # sync: the counted tokens
    rows_b, rows_t = rp.counted_rows(b.counted, b.tok_shape, b.logits_start)
    y = b.ids.reshape(-1)[pos]
    tau_m = tau[pos] if isinstance(tau, torch.Tensor) and tau.dim() == 1 and tau.numel() > 1 else tau
    if isinstance(tau_m, torch.Tensor) and tau_m.dim() == 0:
        tau_m = float(tau_m)
    logits3 = b.logits3
    if sampling_mask is not None:
        with checks.one_host_read():  # every rank holds the same sets (agreed): the same error everywhere
            token_ids, offsets, invalid = check_sampling_mask(sampling_mask, y, vp.V, host, pos)
        restored, lse_full = None, None
    else:
        (top_k, top_p, min_p), rule_bad = rules
        at = lambda x: x[pos] if isinstance(x, torch.Tensor) else x  # noqa: E731
        no_k = missing_k(at(top_k), y, host)
        token_ids, offsets, restored, invalid, lse_full = rebuilt_sets(
            logits3, rows_b, rows_t, y, tau_m, at(top_k), at(top_p), at(min_p), vp, scale, softcap)
        invalid = invalid | no_k
        for x in rule_bad:
            if x is not None:
                invalid = invalid | x[pos]
        refuse_unbuilt(invalid, host)
    logp, ent, flags, lse_kept = merge(logits3, rows_b, rows_t, y, tau_m, token_ids, offsets, vp, scale, softcap)
    bad = (flags != 0) | invalid
    if host:
        n = b.counted.numel()
        checks.raise_on_flags(torch.zeros(n, dtype=flags.dtype, device=flags.device).scatter(0, pos, flags),
                              b.tok_shape)
    # NaN where invalid, the upstream gradient passed on: a NaN coefficient reaches the token's kept entries of
    # this slice, as on one process (a malformed cu_seqlens: every gradient entry of the sets NaN, spec 6)
    poison = torch.where(bad, float("nan"), 0.0).to(logp.dtype)
    logp, ent = logp + poison, ent + poison
    mass = None if lse_full is None else torch.exp(lse_kept - lse_full)  # the full softmax's mass on the set
    n = b.counted.numel()
    zero = torch.zeros(n, dtype=logp.dtype, device=logp.device)
    metrics = rp.replay_metrics(offsets, restored, mass, bad=bad)
    return zero.scatter(0, pos, logp), zero.scatter(0, pos, ent), metrics
