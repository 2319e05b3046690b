"""For tests/test_joint.py: the sampler's kept sets (spec 13) of one drawn example (joint_strategies.replays).

The reference side works on s, the float64 values the sampler draws from (the reference's view Zr over the
config's temperature, or each row over its own tau), at the counted positions in the packed order
(row-major over the padded form's counted positions, as the call numbers its sets):

    sets  = gtpo_sampling.kept_sets(s[mask], 1, top_k, top_p, min_p, ids[mask])   (or random sets holding y)
    keep  = (B, T, V) bool, each counted row's set (uncounted rows: everything)
    reference loss = gtpo_reference.gtpo_loss(where(keep, z, -inf) / tau, ...)       (the same distribution)

and the metrics of spec 13 (kept_mass, mean_kept_size, replay_restored_frac) from
gtpo_sampling.sampling_metrics on the same rows. The call's side: the rules as numbers, (B,) / (B, 1)
per completion or (B, T) / packed (N,) per token tensors, or the sets as sampling_mask."""
import torch
from hypothesis import assume

from gtpo_reference import gtpo_sampling as rs
from joint_strategies import RULE_VALUES

CUT = 1e-4  # relative distance kept between a rule's decision and its cut (the call rebuilds in float32)


def rule_values(j, d):
    """{name: (the call's value, (B, T) float64 per token)} for the drawn rules; tensors hold values exact
    in their dtype (top_k int64 or int32, top_p / min_p float32)."""
    g = torch.Generator().manual_seed(j.seed + 13)
    out = {}
    for name, (value, shape) in sorted(j.rules.items()):
        choices = torch.tensor(RULE_VALUES[name], dtype=torch.float64)
        if shape == "num":
            out[name] = (value, torch.full((j.B, j.T), float(value), dtype=torch.float64))
            continue
        n = (j.B, 1) if shape in ("B", "B1") else (j.B, j.T)
        v = choices[torch.randint(0, len(choices), n, generator=g)]
        if name == "top_k":
            api = v.to(torch.int32 if j.seed % 2 else torch.int64)
        else:
            api = v.float()
        per_token = api.double().expand(j.B, j.T).contiguous()
        if shape == "B":
            api = api[:, 0]
        elif shape == "BT" and j.packed:
            api = d.pack(api)
        out[name] = (api, per_token)
    return out


def random_sets(j, d, shuffled):
    """(token_ids, offsets): for each counted token a random subset of the vocabulary holding its sampled
    id (ids at -inf included when drawn), in ascending order or shuffled."""
    g = torch.Generator().manual_seed(j.seed + 17)
    ids, counts = [], [0]
    for y in d.ids[d.mask].tolist():
        others = torch.tensor([v for v in range(j.V) if v != y], dtype=torch.long)
        k = int(torch.randint(0, j.V, (1,), generator=g))
        row = torch.cat([torch.tensor([y]), others[torch.randperm(others.numel(), generator=g)[:k]]])
        row = row[torch.randperm(row.numel(), generator=g)] if shuffled else row.sort().values
        ids.append(row)
        counts.append(row.numel())
    token_ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)
    return token_ids, torch.tensor(counts, dtype=torch.long).cumsum(0)


def clear_of_cuts(s, k, top_p, min_p):
    """The smallest distance (relative) between a decision of vLLM's rules on the float64 row s (V,) and
    its cut, following gtpo_sampling.kept_set_row: min-p's exp(s_v - max s) from min_p; top-k's other values
    from the k-th largest; top-p's cumulative masses from 1 - top_p, and the values either side of its cut
    (an exact tie across it is ordered by id on both sides: then the other values from the tied one).
    Infinite when no rule decides anything."""
    x = s.tolist()
    V = len(x)
    keep = [v > float("-inf") for v in x]
    if not any(keep):
        return float("inf")
    slack = float("inf")
    if min_p > 0:
        q = torch.exp(s - s.max()).tolist()
        slack = min([slack] + [abs(q[v] - min_p) / min_p for v in range(V) if keep[v]])
        keep = [keep[v] and q[v] >= min_p for v in range(V)]
    if k > 0:
        vals = sorted((x[v] for v in range(V) if keep[v]), reverse=True)
        if k < len(vals):
            kth = vals[k - 1]
            slack = min([slack] + [abs(u - kth) / max(1.0, abs(kth)) for u in vals if u != kth])
            keep = [keep[v] and x[v] >= kth for v in range(V)]
    if top_p < 1:
        order = sorted((v for v in range(V) if keep[v]), key=lambda v: (x[v], v))
        cum = torch.cumsum(torch.softmax(torch.tensor([x[v] for v in order], dtype=torch.float64), 0), 0).tolist()
        slack = min([slack] + [abs(c - (1 - top_p)) for c in cum[:-1]])
        dropped = [v for v, c in zip(order[:-1], cum[:-1]) if c <= 1 - top_p]
        if dropped:
            a = max(x[v] for v in dropped)
            b = min(x[v] for v in order if v not in dropped)
            if a == b:
                slack = min([slack] + [abs(x[v] - a) / max(1.0, abs(a)) for v in order if x[v] != a])
            else:
                slack = min(slack, (b - a) / max(1.0, abs(a)))
    return slack


class Replay:
    """One example's kept sets: `api` the call's keywords, `keep` (B, T, V) bool (None: no kept set),
    `metrics` the reference's kept_mass, mean_kept_size, replay_restored_frac (float64, 0-d)."""

    def __init__(self, j, d, S):
        """S (B, T, V) float64: the values the sampler draws from (the reference's logits over tau)."""
        self.api, self.keep, self.metrics = {}, None, {}
        if j.replay is None:
            return
        m = d.mask
        rows, y = S[m], d.ids[m].long()
        rules = rule_values(j, d)
        per = {name: rules[name][1][m] if name in rules else None for name in ("top_k", "top_p", "min_p")}
        if j.replay == "rules" or j.sets == "rules":
            token_ids, offsets, restored = rs.kept_sets(rows, 1.0, per["top_k"], per["top_p"], per["min_p"], y)
        else:
            (token_ids, offsets), restored = random_sets(j, d, j.sets == "random-shuffled"), None
        if j.replay == "rules":
            off = {"top_k": 0.0, "top_p": 1.0, "min_p": 0.0}
            for r in range(rows.shape[0]):
                at = {n: (float(per[n][r]) if per[n] is not None else off[n]) for n in off}
                assume(clear_of_cuts(rows[r], int(at["top_k"]), at["top_p"], at["min_p"]) > CUT)
            self.api = {name: v[0] for name, v in rules.items()}
        else:
            dtype = torch.int32 if j.seed % 3 == 0 else torch.int64
            self.api = {"sampling_mask": (token_ids.to(dtype), offsets.to(dtype))}
            restored = None  # spec 13: 0 with a recorded mask
        keep = torch.ones(S.shape, dtype=torch.bool)
        counted = keep[m]
        counted[:] = False
        for r in range(rows.shape[0]):
            counted[r, token_ids[int(offsets[r]):int(offsets[r + 1])]] = True
        keep[m] = counted
        self.keep = keep
        self.metrics = rs.sampling_metrics(rows, (token_ids, offsets), 1.0, restored)

    def masked(self, z):
        """z (B, T, V) with every entry outside a counted token's kept set at -inf (differentiable)."""
        return z if self.keep is None else z.masked_fill(~self.keep, float("-inf"))
