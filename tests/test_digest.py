"""The agreement's checksums (spec 12, distributed/digest.py) formed by their kernels in the row
(kernels/digest_triton) equal their torch definition bit for bit, for every dtype a rank may pass
(floats by value: -0.0 as 0.0, every NaN one NaN; bfloat16, integers, bools), with and without the
positions a mask selects, empty, one element and several blocks; the options' fingerprint with tensors
among them; the tokens' count, checksum and largest id, padded and packed (with an empty completion)."""
import pytest
import torch

from gtpo_kernels.core import batch
from gtpo_kernels.distributed import digest

DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool)


def _both(d, width=1):
    """(the row's slots after the Digest's kernel, the torch form's values)."""
    row = torch.full((2 + width,), 5, dtype=torch.int64)  # a slot's neighbours must stay as they are
    row[1] = d.const
    assert digest.kernels_on(row.device, d._tensors())  # the kernels form it (Triton's interpreter here)
    digest.write_row([d], row)  # (field 0 at slot 1)
    assert row[0] == 5 and row[-1] == 5, row
    v = d.value()
    v = torch.stack(list(v)) if d.kind == "tokens" else v.reshape(1)
    return row[1:1 + v.numel()].tolist(), v.tolist()


def _values(dtype, n, g):
    x = torch.randn(n, generator=g) * 3
    if n > 3:
        x[0], x[1], x[2] = float("nan"), -0.0, 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 5, 2500])
def test_values_and_fingerprints_equal_their_definition(dtype, n):
    g = torch.Generator().manual_seed(n)
    x = _values(dtype, n, g)
    where = torch.rand(n, generator=g) > 0.4
    for w in (None, where):
        a, b = _both(digest.Digest.values(x, w))
        assert a == b, (w is None, a, b)
    for options in ((x,), ("torch", 1.5, x, 3, x[:1])):
        d = digest.fingerprint_field(options)
        assert isinstance(d, digest.Digest)
        a, b = _both(d)
        assert a == b == [int(digest.fingerprint(options))], (a, b)


def test_the_checksums_tell_values_apart():
    """Not a constant: a changed value, a moved value, or a masked position changes the checksum."""
    x = torch.arange(1.0, 9.0)
    base = _both(digest.Digest.values(x))[0]
    y = x.clone()
    y[3] += 1
    swapped = x[[1, 0, *range(2, 8)]]
    where = torch.ones(8, dtype=torch.bool)
    where[5] = False
    others = [_both(digest.Digest.values(v, w))[0] for v, w in ((y, None), (swapped, None), (x, where))]
    assert all(o != base for o in others) and len({tuple(o) for o in others}) == 3


@pytest.mark.parametrize("packed", [False, True])
def test_tokens_equal_their_definition(packed):
    g = torch.Generator().manual_seed(3)
    if packed:
        lengths = torch.tensor([3, 0, 5, 2])
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        b = batch.prepare_tokens(torch.randint(0, 50, (10,), generator=g), torch.rand(10, generator=g) > 0.2,
                                 cu_seqlens=cu)
    else:
        b = batch.prepare_tokens(torch.randint(0, 50, (4, 6), generator=g), torch.rand(4, 6, generator=g) > 0.3)
    a, ref = _both(digest.token_fields(b)[0], 3)
    assert a == ref and ref[0] > 0 and ref[2] >= 0, (a, ref)


def test_views_with_strides_equal_their_definition():
    """A column of a matrix (stride 2): the kernel reads its values, not the storage after its first one, so
    ranks passing the same values as a view or a copy agree."""
    g = torch.Generator().manual_seed(5)
    both = torch.randn(6, 2, generator=g)
    view, where = both[:, 0], (torch.rand(6, 2, generator=g) > 0.3)[:, 1]
    assert view.stride() == (2,)
    for w in (None, where):
        a, b = _both(digest.Digest.values(view, w))
        assert a == b == _both(digest.Digest.values(view.contiguous(), None if w is None else w.contiguous()))[0]


def test_backend_torch_forms_them_with_torch():
    """Inside a call with backend='torch' (entry.backend_kernels) no digest kernel runs: the same values."""
    from gtpo_kernels.core import entry
    x = torch.randn(50)
    token = entry._KERNELS.set(False)
    try:
        assert not digest.kernels_on(x.device, [x])
        torch_row = torch.zeros(2, dtype=torch.int64)
        digest.Digest.values(x).write(torch_row, 1)
    finally:
        entry._KERNELS.reset(token)
    kernel_row = torch.zeros(2, dtype=torch.int64)
    digest.write_row([digest.Digest.values(x)], kernel_row)
    assert torch.equal(torch_row, kernel_row) and torch_row[1] != 0


@pytest.mark.parametrize("n_values", [2, 8])
def test_a_whole_row_in_one_launch_equals_the_torch_forms(n_values):
    """digest.write_row, as the agreement forms its row: values (every dtype, with and without a mask of any
    dtype, a strided view), a fingerprint with two tensor options (the second added into the same slot after
    the first) and the tokens (packed, a float mask) in one launch of _row_kernel per SLOTS terms, plus one for
    the fingerprint's second tensor; every slot equal to the torch forms' row, the other slots untouched."""
    from bench.launches import counting
    from gtpo_kernels.core import entry
    from gtpo_kernels.kernels import digest_triton
    g = torch.Generator().manual_seed(n_values)
    lengths = torch.tensor([3, 0, 5, 2])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    mask = (torch.rand(10, generator=g) > 0.2).float()
    b = batch.prepare_tokens(torch.randint(0, 50, (10,), generator=g), mask, cu_seqlens=cu)
    fields = [7]
    for k in range(n_values):
        x = _values(DTYPES[k % len(DTYPES)], [0, 1, 5, 2500][k % 4], g)
        where = None if k % 2 else (torch.rand(x.numel(), generator=g) > 0.5).to([torch.bool, torch.float32][k % 3 % 2])
        fields.append(digest.Digest.values(x if k != 3 else torch.randn(5, 2, generator=g)[:, 1], where
                                           if k != 3 else None))
    fields += [digest.fingerprint_field(("torch", 1.5, torch.randn(3, generator=g), 3, torch.tensor(0.25))), 11]
    fields += digest.token_fields(b)

    def row():
        r = torch.full((len(fields) + 2,), 5, dtype=torch.int64)
        r[1:1 + len(fields)] = torch.tensor([f.const if isinstance(f, digest.Digest) else f for f in fields])
        return r
    with counting() as c:
        kernel_row = row()
        digest.write_row(fields, kernel_row)
    token = entry._KERNELS.set(False)
    try:
        torch_row = row()
        digest.write_row(fields, torch_row)
    finally:
        entry._KERNELS.reset(token)
    assert torch.equal(kernel_row, torch_row), (kernel_row, torch_row)
    assert kernel_row[0] == 5 and kernel_row[-1] == 5 and (kernel_row[2:-2] != 5).all()
    n_terms = n_values + 1
    launches = -(-n_terms // digest_triton.SLOTS) + 1
    assert c.triton_names == {"_row_kernel": launches - 1, "_terms_kernel": 1}, dict(c.triton_names)


def _check_case(kind, dtype, n, where_dtype, g, fail_at):
    """A RowCheck of `kind` over n values of `dtype` (valid everywhere but, fail_at, one position that may or
    may not be selected) and its torch form."""
    from gtpo_kernels.core.host_read import RowCheck
    V = None
    if kind in ("cu", "cu_max"):  # a cu_seqlens of n - 1 completions (n >= 1), with no `where`
        cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.randint(0, 6, (max(n - 1, 0),), generator=g).cumsum(0)])
        x = cu[:n].to(dtype)
        longest = int((cu[1:n] - cu[:n - 1]).max()) if n > 1 else 0
        V = int(cu[n - 1]) if kind == "cu" else longest - (fail_at is not None)
        if kind == "cu" and fail_at is not None:  # not from 0, not to N, or decreasing (each alone)
            mode = fail_at % 3 if n > 1 else 0
            if mode == 0:
                x[0] = 1
            elif mode == 1:
                x[n - 1] = x[n - 1] + [1, -1][fail_at // 3 % 2]  # past N, or short of it
            else:
                k = 1 + fail_at % (n - 1)
                x[k] = x[k - 1] - 1
        bad = ((lambda: batch.cu_malformed(x, V).reshape(1)) if kind == "cu" else
               (lambda: ((x[1:].long() - x[:-1].long()).max().reshape(1) if n > 1 else torch.zeros(1)) > V))
        return RowCheck(x, None, kind, V, bad), x, None
    if kind == "atleast":
        V = n % 2
        x = (torch.rand(n, generator=g) * 3 + V).to(dtype)
    elif kind == "positive":  # a temperature: down to a float32 tau whose 1 / tau is just finite
        x = (torch.rand(n, generator=g) * 2 + 0.01).to(dtype)
        if n > 2:
            x[n // 2] = 3e-39 if dtype == torch.float32 else 1e-300
    elif kind == "finite":
        x = (torch.randn(n, generator=g) * 3).to(dtype)
    elif kind == "binary":
        x = (torch.rand(n, generator=g) > 0.5).to(dtype)
    else:
        V = [37, float("inf")][n % 2]
        x = torch.randint(0, 37, (n,), generator=g).to(dtype)
    where = None if where_dtype is None else (torch.rand(n, generator=g) > 0.4).to(where_dtype)
    if fail_at is not None:
        if kind == "atleast":
            x[fail_at] = [V - 0.5, float("nan"), float("inf")][n % 3]
        elif kind == "positive":  # 0, below 0, NaN, inf, or 1 / tau not finite
            x[fail_at] = [0.0, -0.5, float("nan"), float("inf"), 2e-39 if dtype == torch.float32 else 1e-320][n % 5]
        elif kind == "finite":
            x[fail_at] = [float("nan"), float("inf"), -float("inf")][n % 3]
        elif kind == "binary":
            x[fail_at] = 2 if dtype != torch.float32 else 0.5
        else:
            x[fail_at] = [-1, 37][int(torch.randint(0, 2, (), generator=g))] if V == 37 else -1
    sel = torch.ones(n, dtype=torch.bool) if where is None else where != 0
    bad = {"finite": lambda: ~torch.isfinite(x.double()), "binary": lambda: (x != 0) & (x != 1),
           "atleast": lambda: ~(torch.isfinite(x.double()) & (x.double() >= V)),
           "positive": lambda: ~(torch.isfinite(x) & (x > 0) & torch.isfinite(x.reciprocal())),
           "range": lambda: (x.long() < 0) | (x.long() >= V)}[kind]
    return RowCheck(x, where, kind, V, lambda: sel & bad()), x, where


@pytest.mark.parametrize("seed", range(6))
def test_the_row_kernel_s_value_checks_equal_their_torch_forms(seed):
    """Validating on vocabulary-parallel logits, the row's kernel forms the value checks' predicates (core.host_read
    .RowCheck; agree.deferred): finite (every float dtype), 0 or 1 (a mask of any dtype), ids in [0, V) (V finite or
    inf), finite and >= 0 or 1, finite and > 0 with a finite inverse (float32 and float64), at the positions
    `where` (any dtype, or None) selects, several blocks long or
    empty; a cu_seqlens (int32 or int64) from 0 to N, never decreasing, its completions no longer than a bound;
    each on the term of a checksum of the same tensor or on a term of its own. The row's error flag is set exactly when a torch form
    says a selected value fails, the checksums are the torch forms' (a check changes no slot), in one launch."""
    from bench.launches import counting
    g = torch.Generator().manual_seed(100 + seed)
    kinds = [("finite", torch.float32), ("finite", torch.bfloat16), ("finite", torch.float64), ("finite", torch.float16),
             ("binary", torch.int64), ("binary", torch.float32), ("binary", torch.uint8), ("range", torch.int64),
             ("range", torch.int32), ("atleast", torch.float32), ("atleast", torch.float64), ("positive", torch.float32),
             ("positive", torch.float64), ("cu", torch.int64),
             ("cu", torch.int32), ("cu_max", torch.int64), ("cu_max", torch.int32)]
    def case(kind, dtype, trial):
        n = int(torch.randint(0, 2600, (), generator=g)) if trial else 1 + seed
        n = max(n, 1) if kind in ("cu", "cu_max") else n
        fail_at = int(torch.randint(0, n, (), generator=g)) if n and torch.rand((), generator=g) < 0.5 else None
        return _check_case(kind, dtype, n, [None, torch.bool, torch.float32][(seed + trial) % 3], g, fail_at)
    alone = [case(kind, dtype, 1 + seed % 3) for kind, dtype in kinds]
    for kind in ("cu", "cu_max"):  # and each way to fail: from 1, past N, decreasing, short of N (fail_at 0, 1, 2, 4)
        alone += [_check_case(kind, torch.int64, 2 + seed, None, g, at) for at in (0, 1, 2, 4)]
    for c in alone:  # each alone: the row's flag is its torch form's
        row = torch.zeros(2, dtype=torch.int64)
        digest.write_row([], row, [c[0]])
        assert row.tolist() == [int(bool(c[0].torch_bad().any())), 0], (c[0].kind, c[1], row)
    for trial in range(4):
        picked = [kinds[int(i)] for i in torch.randperm(len(kinds), generator=g)[:3]]
        cases = [case(kind, dtype, trial) for kind, dtype in picked]
        # the first check's tensor is also a checksum's (its term carries the check), the others stand alone
        fields = [digest.Digest.values(cases[0][1], cases[0][2]), 3]
        expected = any(bool(c.torch_bad().any()) for c, _, _ in cases)

        def row():
            return torch.tensor([0, 0, 3, 5], dtype=torch.int64)
        with counting() as cnt:
            kernel_row = row()
            digest.write_row(fields, kernel_row, [c for c, _, _ in cases])
        torch_row = row()
        torch_row[1:2] = fields[0].value().reshape(1)
        assert kernel_row[0] == int(expected), (trial, picked, kernel_row, expected)
        assert torch.equal(kernel_row[1:], torch_row[1:]), (kernel_row, torch_row)
        assert cnt.launches == 1, dict(cnt.ops)



@pytest.mark.parametrize("seed", range(4))
def test_per_row_values_and_checks_equal_their_spread(seed):
    """Per-completion rollout weights (B,) on padded rows of T tokens (digest kind 'rows', a RowCheck with
    row_length): the row's kernel reads each at its tokens, never spreading them. Its checksum is bitwise the
    spread's (B * T,) values digest at the same mask (so per-token and per-completion forms of the same weights
    agree) and the torch form's; its check fails exactly where a counted token reads a failing weight (a NaN or
    negative weight of a row whose tokens are all masked out passes)."""
    from gtpo_kernels.core.host_read import RowCheck
    g = torch.Generator().manual_seed(300 + seed)
    B, T = [(4, 5), (3, 1), (70, 37), (2, 0)][seed]
    w = torch.rand(B, generator=g).to([torch.float32, torch.float64, torch.bfloat16, torch.float32][seed]) + 0.5
    mask = (torch.rand(B, T, generator=g) > 0.3).to([torch.bool, torch.float32, torch.int64, torch.bool][seed])
    if B > 2 and T:
        mask[1] = 0
        w[1] = float("nan")  # read by no counted token
    for where in (mask, None):
        spread = w.repeat_interleave(T)
        d = digest.Digest("rows", 0, (w, where, T))
        kernel, torch_form = _both(d)
        assert kernel == torch_form == [int(digest.values_digest(spread, where))], (kernel, torch_form)
    for k in ([] if B < 3 or not T else [1, 0, B - 1]):
        bad_w = w.clone()
        bad_w[k] = [-0.25, float("inf"), float("nan")][k % 3]
        for where in (mask, None):
            sel = torch.ones(B * T, dtype=torch.bool) if where is None else where.reshape(-1) != 0
            torch_bad = sel & ~(torch.isfinite(bad_w.double()) & (bad_w.double() >= 0)).repeat_interleave(T)
            expect = bool(torch_bad.any())
            row = torch.zeros(2, dtype=torch.int64)
            digest.write_row([], row, [RowCheck(bad_w, where, "atleast", 0, lambda: torch_bad, row_length=T)])
            assert row.tolist() == [int(expect), 0], (k, where is None, row)
            assert expect == (where is None or bool(mask[k].any())), k  # (row 1: every token masked out)


@pytest.mark.parametrize("seed", range(4))
def test_per_completion_values_of_a_packed_batch_equal_their_spread(seed):
    """The same for the packed form (kind 'rows' and a RowCheck with rows (cu_seqlens, N): Batch.seq_rows): the
    row's kernel finds each token's completion in cu_seqlens (int32 or int64; empty completions, a first or
    last one among them; N past one BLOCK), never spreading the values: the checksum is bitwise the spread's
    values digest (layout.spread_packed) and the torch form's, and the check fails exactly where a counted
    token reads a failing value (one whose completion is empty or masked out passes)."""
    from gtpo_kernels.core.host_read import RowCheck
    from gtpo_kernels.core.layout import spread_packed
    g = torch.Generator().manual_seed(400 + seed)
    lengths = [torch.tensor([4, 0, 5, 3]), torch.tensor([0, 2, 2, 0, 1]), torch.randint(0, 60, (70,), generator=g),
               torch.tensor([3])][seed]
    B = lengths.numel()
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to([torch.int64, torch.int32][seed % 2])
    N = int(cu[-1])
    w = torch.rand(B, generator=g).to([torch.float32, torch.float64, torch.bfloat16, torch.float32][seed]) + 0.5
    mask = (torch.rand(N, generator=g) > 0.3).to([torch.bool, torch.float32, torch.int64, torch.bool][seed])
    if B > 2:
        mask[int(cu[2]):int(cu[3])] = 0
        w[2] = float("nan")  # read by no counted token
    for where in (mask, None):
        spread = spread_packed(w, cu, N)
        assert torch.equal(spread.isnan(), w.repeat_interleave(lengths).isnan())  # (the spread itself)
        kernel, torch_form = _both(digest.Digest("rows", 0, (w, where, (cu, N))))
        assert kernel == torch_form == [int(digest.values_digest(spread, where))], (kernel, torch_form)
    for k in range(B if B < 6 else 6):
        bad_w = w.clone()
        bad_w[k] = [-0.25, float("inf"), float("nan")][k % 3]
        for where in (mask, None):
            sel = torch.ones(N, dtype=torch.bool) if where is None else where.reshape(-1) != 0
            torch_bad = sel & ~(torch.isfinite(bad_w.double()) & (bad_w.double() >= 0)).repeat_interleave(lengths)
            expect = bool(torch_bad.any())
            row = torch.zeros(2, dtype=torch.int64)
            digest.write_row([], row, [RowCheck(bad_w, where, "atleast", 0, lambda: torch_bad, row_length=(cu, N))])
            assert row.tolist() == [int(expect), 0], (k, where is None, row)
            fails = ~(torch.isfinite(bad_w.double()) & (bad_w.double() >= 0))  # (completion by completion)
            assert expect == any(bool(fails[j]) and bool(sel[int(cu[j]):int(cu[j + 1])].any()) for j in range(B)), k


@pytest.mark.parametrize("where", ["none", "counted", "masked_out"])
def test_a_flushed_subnormal_temperature_is_named(where):
    """A device that flushes float32 subnormals to 0 finds 1 / tau not finite for tau = 3e-39, where torch's
    form on the host finds it finite: when the agreement row says a check failed and no torch form does, the
    failing rank names the subnormal temperature (not 'its host check passed'), where one is selected; else
    nothing is named here (the agreement then reports the device-only failure). Simulated: the deferred
    block's checks as the agreement receives them."""
    from gtpo_kernels.core import host_read
    from gtpo_kernels.core.sampling import check_temperature
    tau = torch.tensor([[0.7, 3e-39, 1.0]])
    mask = torch.tensor([[1, 0 if where == "masked_out" else 1, 1]])
    got = {}

    class Defer:
        row_device = tau.device

        def __call__(self, failed, raise_first, row_checks):
            got.update(raise_first=raise_first, checks=row_checks)
    with host_read.one_host_read(defer=Defer()):
        check_temperature(tau, 1, 3, 3, tau.device, counted=None if where == "none" else (lambda: mask.reshape(-1) != 0),
                          validate=True, where=None if where == "none" else mask)
    assert [c.kind for c in got["checks"]] == ["positive"] and not bool(got["checks"][0].torch_bad().any())
    if where == "masked_out":
        got["raise_first"]()  # (no selected subnormal: nothing named)
    else:
        with pytest.raises(ValueError, match="temperature must be finite and > 0.*a subnormal value"):
            got["raise_first"]()


def test_a_row_without_its_constants_rebuilds_the_row_with_them():
    """agree's row: the host's values travel as their checksum (the last slot) and the raw field as it is,
    written whole by the row's kernel (no tensor made from host data, the row's prior contents overwritten),
    equal to the torch forms' row made on the host; agree.rebuilt adds the Digests' constants back: the fields
    of the row with them (write_row with the constants in place), slot for slot."""
    from bench.launches import counting
    from gtpo_kernels.core import entry
    from gtpo_kernels.distributed import agree
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 3, 3, 8, 10])
    mask = (torch.rand(10, generator=g) > 0.2).float()
    b = batch.prepare_tokens(torch.randint(0, 50, (10,), generator=g), mask, cu_seqlens=cu)
    fields = [37, 4, 10, digest.Digest("values", 12345, (torch.randn(10, generator=g), mask)),
              digest.fingerprint_field(("torch", 1.5, torch.randn(3, generator=g), torch.tensor(0.25))), 11,
              digest.Digest.values(torch.randn(4, generator=g)), *digest.token_fields(b)]
    layout = agree._layout(fields, 1)
    assert [k for k, _ in layout].count("digest") == 3 and layout[0] == ("raw", 37)
    with counting() as c:
        kernel_row = torch.full((len(fields) + 2,), 5, dtype=torch.int64)
        digest.write_row(fields, kernel_row, head=agree._head_args(layout))
    assert c.creations == 0 and c.triton_names["_row_kernel"] == 1, (c.creations, dict(c.triton_names))
    token = entry._KERNELS.set(False)
    try:
        torch_row = torch.tensor(agree._head(layout), dtype=torch.int64)
        digest.write_row(fields, torch_row, head=False)
        legacy = torch.tensor([0] + [f.const if isinstance(f, digest.Digest) else f for f in fields])
        digest.write_row(fields, legacy)
    finally:
        entry._KERNELS.reset(token)
    assert torch.equal(kernel_row, torch_row), (kernel_row, torch_row)
    assert kernel_row[-1] == agree._key(layout) and kernel_row[1] == 37 and kernel_row[2] == kernel_row[3] == 0
    assert agree.rebuilt(layout, kernel_row.tolist()) == legacy[1:].tolist()
    assert legacy[4] != kernel_row[4]  # (the constant is not in the row)
    moved = agree._layout([38, 5, *fields[2:]], 1)  # the raw field is not in the key; the others are
    assert agree._key(moved) != agree._key(layout) and agree._key(agree._layout([38, *fields[1:]], 1)) == agree._key(layout)
