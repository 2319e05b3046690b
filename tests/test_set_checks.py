"""The recorded kept sets checked on the device (kernels/set_check_triton.py, the LM head's unvalidated
replay) against core.sampling.check_sampling_mask_flat(validate=False), their eager twin: the same invalid
tokens for every problem a set can have (an id outside [0, V), a repeated id, the sampled id missing,
offsets malformed, or well formed but not one set per counted token), the same flat offsets where the offsets are well
formed (every set empty where not), and the kept ids with an id outside [0, V) as 0."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from gtpo_kernels.core.sampling import check_sampling_mask_flat
from gtpo_kernels.kernels.set_check_triton import flat_set_checks

PROBLEMS = ["none", "outside", "negative", "repeat", "missing", "decreasing", "short", "one-set-less", "start",
            "set-dropped"]


def recorded(g, n, V, problem):
    """(ids (n,), counted (n,), (token_ids, offsets)) of random valid sets, then `problem` put in."""
    ids = torch.randint(0, V, (n,), generator=g)
    counted = torch.rand(n, generator=g) < 0.75
    counted[int(torch.randint(0, n, (1,), generator=g))] = True
    sets = []
    for y in ids[counted].tolist():
        others = [v for v in torch.randperm(V, generator=g).tolist() if v != y][:int(torch.randint(0, 4, (1,),
                                                                                                   generator=g))]
        s = others + [y]
        sets.append([s[i] for i in torch.randperm(len(s), generator=g).tolist()])
    m = int(torch.randint(0, len(sets), (1,), generator=g))
    if problem == "outside":
        sets[m].append(V + int(torch.randint(0, 3, (1,), generator=g)))
    elif problem == "negative":
        sets[m].insert(0, -1)
    elif problem == "repeat":
        sets[m].append(sets[m][0])
    elif problem == "missing":
        y = int(ids[counted][m])
        sets[m] = [v for v in sets[m] if v != y]
    if problem == "set-dropped":  # well-formed offsets, but one set fewer than counted tokens
        sets = sets[:-1]
    offsets = torch.tensor([0] + [len(s) for s in sets]).cumsum(0)
    token_ids = torch.tensor([v for s in sets for v in s], dtype=torch.long)
    if problem == "decreasing" and len(sets) > 1:
        offsets[1], offsets[2] = offsets[2] + 1, offsets[1]
    elif problem == "short":
        offsets[-1] -= 1
    elif problem == "one-set-less":
        offsets = offsets[:-1] if offsets.numel() > 1 else offsets
    elif problem == "start":
        offsets = offsets + 1
    return ids, counted, (token_ids, offsets)


@settings(max_examples=examples(30))
@given(n=st.integers(1, 9), V=st.integers(2, 12), problem=st.sampled_from(PROBLEMS), seed=st.integers(0, 10**6),
       clamp=st.booleans())
def test_device_checks_equal_the_eager_checks(n, V, problem, seed, clamp):
    g = torch.Generator().manual_seed(seed)
    ids, counted, (token_ids, offsets) = recorded(g, n, V, problem)
    want_ids, want_flat, want_invalid = check_sampling_mask_flat((token_ids, offsets), ids, counted, V, False)
    flat, invalid, kept = flat_set_checks(want_ids, offsets.long(), ids, counted, V, clamp)
    assert torch.equal(invalid, want_invalid), (problem, invalid, want_invalid)
    if problem == "none":
        assert not invalid.any()
    malformed = (offsets[0] != 0) | (offsets[-1] != token_ids.numel()) | (offsets.diff() < 0).any() | \
        (offsets.numel() != int(counted.sum()) + 1)
    if bool(malformed):
        assert invalid.all() and (flat == 0).all()
    else:
        assert torch.equal(flat, want_flat)
    if clamp:
        assert torch.equal(kept, torch.where((want_ids >= 0) & (want_ids < V), want_ids, 0)) or bool(malformed)
    else:
        assert kept is want_ids


@pytest.mark.parametrize("problem", ["outside", "repeat", "missing"])
def test_an_uncounted_tokens_problem_is_ignored(problem):
    """Only counted tokens' sets are checked: the same batch with the troubled token uncounted (its set
    removed) has no invalid token."""
    g = torch.Generator().manual_seed(3)
    ids, counted, (token_ids, offsets) = recorded(g, 6, 8, problem)
    flat, invalid, _ = flat_set_checks(token_ids, offsets, ids, counted, 8, True)
    bad = invalid.nonzero().squeeze(1)
    assert bad.numel() == 1 and counted[bad].all()
    c2 = counted.clone()
    c2[bad] = False
    k = int(counted[:int(bad)].sum())  # its set's index among the counted tokens
    keep = torch.ones(token_ids.numel(), dtype=torch.bool)
    keep[offsets[k]:offsets[k + 1]] = False
    sizes = offsets.diff()
    offsets2 = torch.cat([torch.zeros(1, dtype=torch.long), torch.cat([sizes[:k], sizes[k + 1:]]).cumsum(0)])
    _, invalid2, _ = flat_set_checks(token_ids[keep], offsets2, ids, c2, 8, True)
    assert not invalid2.any()
