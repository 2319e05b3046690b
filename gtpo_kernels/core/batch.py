"""The Batch factory: every public call's checked arguments become a `layout.Batch` here (ids, mask,
segments, shapes, advantages and the per-token extras, flattened)."""
from __future__ import annotations

import torch

from . import checks
from .layout import Batch, Lazy, spread_packed


def vocab_contiguous(logits):
    """Rows with vocabulary stride 1 are read in place; anything else is copied once."""
    return logits if logits.stride(-1) == 1 or logits.shape[-1] == 1 else logits.contiguous()


def _padded_tokens(completion_ids, device):
    """Padded form: (N, B, tok_shape, max_len, seg)."""
    if completion_ids.dim() != 2:
        raise ValueError(f"completion_ids must have shape (B, T), got {tuple(completion_ids.shape)}"
                         " (pass cu_seqlens for the packed (N,) form)")
    B, T = completion_ids.shape
    return B * T, B, (B, T), T, Lazy(lambda: torch.arange(B, device=device).repeat_interleave(T))


def _packed_tokens(completion_ids, cu_seqlens, max_seqlen, device, validate, allow_empty=False):
    """Packed form: (N, B, cu_seqlens, max_seqlen, max_len, seg, malformed). Unvalidated, a malformed
    cu_seqlens (not starting at 0, decreasing, not ending at N) becomes a 0-d bool flag on the device and
    a well-formed stand-in (clamped into [0, N], non-decreasing, from 0 to N), so that nothing reads out
    of bounds; the caller turns the flag into NaN outputs."""
    checks.check_int_tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < (1 if allow_empty else 2):
        raise ValueError(f"cu_seqlens must have shape (B + 1,), got {tuple(cu_seqlens.shape)}")
    checks.check_device("cu_seqlens", cu_seqlens, device)
    if completion_ids.dim() != 1:
        raise ValueError(f"completion_ids must have shape (N,) in the packed form, "
                         f"got {tuple(completion_ids.shape)}")
    N, B = completion_ids.shape[0], cu_seqlens.numel() - 1
    given = cu_seqlens
    malformed = _once(lambda: cu_malformed(given, N))
    if validate:  # read with the call's other checks (one host read); until then the stand-in below is used
        def fail():
            raise ValueError(f"cu_seqlens must start at 0, never decrease and end at N = {N} "
                             f"(completion_ids' length), got {given.tolist()}")
        checks.check_cu_seqlens(given, N, malformed, fail)

    @_once
    def cu():  # the stand-in, made on first use (the epilogue kernel forms its own from `given`)
        c = given.long().clamp(0, N).cummax(0).values
        return torch.cat([c.new_zeros(1), c[1:-1], c.new_full((1,), N)])

    lengths = _once(lambda: cu()[1:] - cu()[:-1])

    def longest():  # the longest completion (0 without any)
        return torch.cat([lengths(), lengths().new_zeros(1)]).max()
    if max_seqlen is not None:
        max_seqlen = checks.check_nonneg_int("max_seqlen", max_seqlen)
        if validate:
            ms = max_seqlen

            def short():
                raise ValueError(f"max_seqlen = {ms} is shorter than the longest completion in "
                                 f"cu_seqlens ({int(longest())})")
            checks.check_max_seqlen(given, ms, longest, short)
    seg = Lazy(lambda: torch.repeat_interleave(torch.arange(B, device=device), lengths(), output_size=N))
    max_len = Lazy(lambda: longest().clamp(min=1))  # a tensor: no host sync
    return (N, B, Lazy(lambda: cu().to(given.dtype)), max_seqlen, max_len, seg,
            None if validate else malformed)


def _once(make):
    """make(), computed on the first call and kept."""
    box = []

    def get():
        if not box:
            box.append(make())
        return box[0]
    return get


def cu_malformed(cu_seqlens, N):
    """0-d bool on the device: cu_seqlens does not start at 0, decreases or does not end at N."""
    cu = cu_seqlens.long()
    return (cu[0] != 0) | (cu[-1] != N) | (cu[1:] < cu[:-1]).any()


def _counted(completion_mask, tok_shape, N, device, validate):
    if completion_mask is None:
        return Lazy(lambda: torch.ones(N, dtype=torch.bool, device=device))
    checks.check_tensor("completion_mask", completion_mask)
    checks.check_shape("completion_mask", completion_mask, tok_shape, "completion_ids' shape")
    checks.check_device("completion_mask", completion_mask, device)
    if validate and completion_mask.dtype != torch.bool:
        def fail():
            raise ValueError("completion_mask must hold only 0 and 1 (1 = the token counts); it is a mask, "
                             "not a per-token weight (scale the loss, or pass rollout weights, instead)")
        checks.check_binary(completion_mask, fail)
    return Lazy(lambda: (completion_mask != 0).reshape(-1).contiguous())


def _advantages(advantages, B, device, validate, packed=False):
    """advantages (B,) or (B, 1) -> (B,); non-finite values refused when validating (NaN loss else)."""
    checks.check_tensor("advantages", advantages)
    if advantages.dtype == torch.bool or advantages.dtype.is_complex:
        raise TypeError(f"advantages must be a real tensor, got {advantages.dtype}")
    if tuple(advantages.shape) not in ((B,), (B, 1)):
        of = f" (the completions cu_seqlens delimits: {B + 1} offsets)" if packed else ""
        raise ValueError(f"advantages must have shape (B,) or (B, 1) with B = {B}{of}, "
                         f"got {tuple(advantages.shape)}")
    checks.check_device("advantages", advantages, device)
    if validate:
        checks.check_finite("advantages", advantages)
    return advantages.reshape(B)


@checks.read_once
def prepare_tokens(completion_ids, completion_mask=None, advantages=None, *, cu_seqlens=None,
                   max_seqlen=None, device=None, validate=True, allow_empty=False) -> Batch:
    """The per-token part of a Batch (no logits): ids, counted, seg, shapes, advantages. Unvalidated
    malformed cu_seqlens make every counted id -1 and every advantage NaN (NaN outputs, no sync; the
    0-d flag is kept as b.malformed). allow_empty: zero completions are valid (a data-parallel rank's
    part of a batch)."""
    checks.check_int_tensor("completion_ids", completion_ids)
    device = completion_ids.device if device is None else device
    checks.check_device("completion_ids", completion_ids, device)
    malformed = None
    if cu_seqlens is None:
        N, B, tok_shape, max_len, seg = _padded_tokens(completion_ids, device)
    else:
        cu_given = cu_seqlens
        N, B, cu_seqlens, max_seqlen, max_len, seg, malformed = _packed_tokens(
            completion_ids, cu_seqlens, max_seqlen, device, validate, allow_empty)
        tok_shape = (N,)
    if B == 0 and not allow_empty:
        raise ValueError("the batch is empty: completion_ids needs at least one completion")
    counted = _counted(completion_mask, tok_shape, N, device, validate)
    ids = completion_ids.reshape(-1).contiguous()
    batch = Batch(logits3=None, ids_=ids, counted_=counted, seg_=seg, B=B, logits_start=0, tok_shape=tok_shape,
                  cu_seqlens_=cu_seqlens, max_seqlen=max_seqlen, max_len_=max_len,
                  malformed_=None if malformed is None else Lazy(malformed),
                  mask=None if completion_mask is None else completion_mask.reshape(-1),
                  given=dict(ids=ids, cu_seqlens=None if cu_seqlens is None else cu_given))
    if malformed is not None:  # made on first use: the epilogue kernel reads `given` and flags it itself
        batch.ids_ = Lazy(lambda: torch.where(malformed(), torch.full_like(ids, -1), ids))
    if advantages is not None:
        adv = _advantages(advantages, B, device, validate, cu_seqlens is not None)
        batch.given["adv"] = adv
        batch.adv_ = adv if malformed is None else Lazy(lambda: torch.where(malformed(), float("nan"), adv))
    return batch


def resolve_logits_start(logits, completion_ids, logits_start, cu_seqlens=None):
    """logits_start=None (spec 6): the logits hold exactly one row per token (T rows, packed: N) and
    row t predicts token t; more rows are refused with a hint (a model's (B, P + T, V) logits need
    logits_start = P - 1). An explicit logits_start is checked and kept."""
    if logits_start is not None:
        return checks.check_nonneg_int("logits_start", logits_start)
    if not isinstance(logits, torch.Tensor) or not isinstance(completion_ids, torch.Tensor):
        return 0  # prepare names the argument
    packed = cu_seqlens is not None
    if (logits.dim(), completion_ids.dim()) != ((2, 1) if packed else (3, 2)) or \
            (not packed and logits.shape[0] != completion_ids.shape[0]):
        return 0  # prepare names the argument whose shape is wrong
    dim = 0 if packed else 1
    T_l, T = logits.shape[dim], completion_ids.shape[dim]
    what = "N" if packed else "T"
    if T_l < T:
        raise ValueError(f"logits must hold at least {what} = {T} rows (one per completion token), got {T_l}")
    if T_l > T:
        swapped = "" if logits.shape[-1] != T else f" (their last dimension is {what} = {T}: the vocabulary goes last)"
        raise ValueError(f"logits hold {T_l} rows but completion_ids {T} ({what}){swapped}: with logits_start=None "
                         f"they must be equal; pass logits_start={T_l - T - 1} if row {T_l - T - 1} predicts the first "
                         f"completion token (a model's (B, P + T, V) logits: logits_start=P - 1), or slice them")
    return 0


@checks.read_once
def prepare(logits, completion_ids, completion_mask=None, *, advantages=None, cu_seqlens=None,
            max_seqlen=None, logits_start=None, validate=True, vocab_size=None, **extras) -> Batch:
    """A Batch for the vocabulary passes: prepare_tokens plus the logits and the per-token extras
    (old_logps, ref_logps, lam, n_conf, rollout_is_weights, rollout_logps: see add_extras). vocab_size:
    the whole vocabulary's size when the logits hold a slice of it (vocabulary-parallel)."""
    if cu_seqlens is None:
        checks.check_logits(logits, 3, "(B, T_l, V) (pass cu_seqlens for the packed (N, V) form)",
                            sliced=vocab_size is not None)
    else:
        checks.check_logits(logits, 2, "(N, V) in the packed form (cu_seqlens given)", sliced=vocab_size is not None)
    checks.check_int_tensor("completion_ids", completion_ids)
    if cu_seqlens is None and (completion_ids.dim() != 2 or completion_ids.shape[0] != logits.shape[0]):
        raise ValueError(f"completion_ids must have shape (B, T) with B = {logits.shape[0]} (logits' "
                         f"first dimension), got {tuple(completion_ids.shape)}")
    logits_start = resolve_logits_start(logits, completion_ids, logits_start, cu_seqlens)
    b = prepare_tokens(completion_ids, completion_mask, advantages, cu_seqlens=cu_seqlens,
                       max_seqlen=max_seqlen, device=logits.device, validate=validate)
    if cu_seqlens is None:
        B, T_l, _ = logits.shape
        T = b.tok_shape[1]
        if T_l < logits_start + T:
            raise ValueError(f"logits must hold at least logits_start + T = {logits_start + T} rows "
                             f"in dimension 1, got T_l = {T_l}")
        b.logits3 = vocab_contiguous(logits)
    else:
        N = b.tok_shape[0]
        if logits.shape[0] < logits_start + N:
            raise ValueError(f"logits must hold at least logits_start + N = {logits_start + N} rows, "
                             f"got {logits.shape[0]}")
        b.logits3 = vocab_contiguous(logits).unsqueeze(0)
    b.logits_start = logits_start
    add_extras(b, logits.device, validate=validate, **extras)
    if validate:
        checks.check_ids_in_range(b.ids, lambda: b.counted, b.V if vocab_size is None else vocab_size, b.mask)
    return b


def rollout_weights(b, w, device):
    """rollout_is_weights -> (per token (N,), per completion (B,) or None). Per token: completion_ids'
    shape; per completion: (B, 1), or (B,) in the padded form only (packed, (B,) could be read as (N,)
    per-token weights when N == B: refused); their spread on the tokens is then a Lazy, made on first use
    (the epilogue kernel reads the (B,) weights and never makes it: no launch)."""
    checks.check_float_tensor("rollout_is_weights", w)
    checks.check_device("rollout_is_weights", w, device)
    shape = tuple(w.shape)
    if shape == tuple(b.tok_shape):
        return w.reshape(-1), None
    if shape == (b.B, 1) or (shape == (b.B,) and not b.packed):
        seq = w.reshape(b.B)
        if b.packed and b.B:  # (on the given cu_seqlens: no stand-in, no segments made)
            cu, n = b.given["cu_seqlens"], b.tok_shape[0]
            return Lazy(lambda: spread_packed(seq, cu, n)), seq
        return Lazy(lambda: seq[b.seg]), seq
    if b.packed and shape == (b.B,):
        raise ValueError(f"rollout_is_weights of shape ({b.B},) is ambiguous in the packed form: per-token "
                         f"weights are (N,) = {tuple(b.tok_shape)}; pass per-completion weights as "
                         f"({b.B}, 1)")
    per_seq = f"({b.B}, 1)" if b.packed else f"({b.B}, 1) or ({b.B},)"
    raise ValueError(f"rollout_is_weights must have completion_ids' shape {tuple(b.tok_shape)} (per token) "
                     f"or {per_seq} (per completion), got {shape}")


@checks.read_once
def add_extras(b, device, *, old_logps=None, ref_logps=None, lam=None, n_conf=None, rollout_is_weights=None,
               rollout_logps=None, validate=True):
    """Per-token inputs of the loss, flattened onto the Batch: each of completion_ids' shape, except
    n_conf (B,) and rollout_is_weights (see rollout_weights). Validating, non-finite log-probs, lam and
    weights at counted positions and an n_conf that is not finite and >= 1 are refused (unvalidated they
    give NaN: objective/surrogate.py)."""
    for name, x, attr in (("old_logps", old_logps, "old"), ("ref_logps", ref_logps, "ref"),
                          ("lam", lam, "lam"), ("rollout_logps", rollout_logps, "rollout_logps")):
        if x is not None:
            checks.check_float_tensor(name, x)
            checks.check_shape(name, x, b.tok_shape, "completion_ids' shape")
            checks.check_device(name, x, device)
            setattr(b, attr, x.reshape(-1))
            if validate and name in ("old_logps", "ref_logps", "lam"):  # rollout_logps: NaN counts as 0 (spec 9)
                checks.check_finite(name, getattr(b, attr), lambda: b.counted, b.mask)
    if n_conf is not None:
        checks.check_tensor("n_conf", n_conf)
        if n_conf.dtype == torch.bool or n_conf.dtype.is_complex:
            raise TypeError(f"n_conf must be a real tensor (conflict tokens per completion), got {n_conf.dtype}")
        checks.check_shape("n_conf", n_conf, (b.B,), "(B,)")
        checks.check_device("n_conf", n_conf, device)
        if validate:
            def fail():
                k = int((~(torch.isfinite(n_conf) & (n_conf >= 1))).nonzero()[0, 0])
                raise ValueError(f"n_conf must be finite and >= 1 (conflict_weights' counts: at least 1 per "
                                 f"completion); completion {k} holds {float(n_conf[k])}")
            checks.check_at_least(n_conf, 1, None, None, fail)
        b.n_conf = n_conf
    if rollout_is_weights is not None:
        b.rollout_w_, b.rollout_w_seq = rollout_weights(b, rollout_is_weights, device)
        if validate:
            def fail():
                raise ValueError("rollout_is_weights must be >= 0 and finite at counted positions "
                                 "(see rollout_is_weights() for TRL's modes)")
            if b.rollout_w_seq is None or not b.B:  # per token
                checks.check_at_least(b.rollout_w, 0, lambda: b.counted, b.mask, fail)
            else:  # per completion: read where a counted token of its completion reads it, never spread
                checks.check_at_least(b.rollout_w_seq, 0, lambda: b.counted, b.mask, fail,
                                      seg=(b.seq_rows, lambda: b.seg))
