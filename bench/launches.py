"""Kernel launches and host reads of one call, counted on the CPU as a GPU would make them (spec 8, "One
pass in the call, too").

A launch is a Triton kernel launch (counted where the kernel is started, its own work not looked into) or an
aten op that would launch a device kernel: every op that reads or writes tensor data, i.e. not a view, an
allocation without fill (`empty*`), `detach` / `alias` / `lift_fresh`, nor a host read. A host read is an
op that brings a device value to the host (`_local_scalar_dense`: `item()`, `bool()`, `int()`, `float()`;
`nonzero`, `tolist()` on a device tensor, an index by a boolean mask) or a tensor method that reads values
on the host, called from the package's code (`tolist`, `__bool__`, ... on a CPU tensor never reaches the
dispatcher). A host-to-device copy is a tensor made from Python data (`lift_fresh`, what `torch.tensor`
runs) that then meets device data; counted as `h2d`.

    python -m bench.launches            # the table of every call below, forward + backward
"""
from __future__ import annotations

import collections
import contextlib
import os
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
             "lift_fresh", "lift_fresh_copy", "_local_scalar_dense", "set_", "resize_", "_unsafe_view",
             "is_nonzero", "_has_compatible_shallow_copy_type", "sym_size", "sym_stride", "sym_numel",
             "sym_storage_offset", "record_stream", "_to_copy_noop"}
HOST_READ_OPS = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select", "_unique2",
                 "unique_dim", "unique_consecutive", "bincount", "histc"}
TENSOR_READS = ("__bool__", "item", "__int__", "__float__", "tolist", "__index__")
PACKAGE = os.sep + "gtpo_kernels" + os.sep


def _python_body(func):
    """The Python body of a torch.library.custom_op, or None (aten and other registrations)."""
    if func.namespace in ("aten", "prims", "prim"):
        return None
    from torch._library import custom_ops
    return getattr(custom_ops.OPDEFS.get(f"{func.namespace}::{func._opname}"), "_init_fn", None)


class LaunchCounter(TorchDispatchMode):
    """Counts, per call: `launches` (Triton + aten), `triton`, `aten` (by op name in `ops`), `reads` (host
    reads by where they happened) and `creations` (tensors made from Python data)."""

    def __init__(self):
        super().__init__()
        self.triton = 0
        self.ops = collections.Counter()
        self.reads = collections.Counter()
        self.creations = 0
        self.suspended = 0
        self.in_read = 0
        self.triton_names = collections.Counter()

    @property
    def aten(self):
        return sum(self.ops.values())

    @property
    def launches(self):
        return self.aten + self.triton

    @property
    def host_reads(self):
        return sum(self.reads.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        body = _python_body(func)
        if body is not None and not self.suspended:
            with self:
                return body(*args, **kwargs)
        out = func(*args, **kwargs)
        if self.suspended:
            return out
        name = func.overloadpacket.__name__
        if name in ("lift_fresh", "lift_fresh_copy"):
            self.creations += 1
        if not self.in_read and (name in HOST_READ_OPS or _sync_index(name, args, kwargs)):
            self.reads[f"aten.{name}"] += 1
        if func.is_view or name in NO_LAUNCH:  # (a read that computes, nonzero or bincount, launches too)
            return out
        self.ops[name] += 1
        return out

    def triton_launch(self, name):
        if not self.suspended:
            self.triton += 1
            self.triton_names[name] += 1


def _sync_index(name, args, kwargs):
    """An op whose output size is a device value: a boolean-mask index, repeat_interleave without
    output_size."""
    if name in ("index", "index_put", "index_put_"):
        idx = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (idx or ()))
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None and (len(args) < 3 or args[-1] is None)
    return False


@contextlib.contextmanager
def counting():
    """A LaunchCounter over the block: Triton launches (the interpreter's GridExecutor, or a compiled
    kernel's run) counted once each with their own torch work suspended; the package's host reads of
    tensor values counted by the tensor methods that make them."""
    from triton.runtime import interpreter, jit
    counter = LaunchCounter()
    saved_run = interpreter.InterpretedFunction.run
    saved_jit = jit.JITFunction.run
    saved_reads = {name: getattr(torch.Tensor, name) for name in TENSOR_READS}

    def launching(saved):
        def run(self, *args, **kwargs):
            if not kwargs.get("warmup"):
                counter.triton_launch(getattr(self.fn, "__name__", "kernel"))
            counter.suspended += 1
            try:
                return saved(self, *args, **kwargs)
            finally:
                counter.suspended -= 1
        return run

    def reading(name, fn):
        def read(self, *a, **k):
            caller = traceback.extract_stack()[-2]
            if PACKAGE in caller.filename and not counter.suspended and not counter.in_read:
                counter.reads[f"{caller.filename.split(PACKAGE)[1]}:{caller.lineno}"] += 1
            counter.in_read += 1
            try:
                return fn(self, *a, **k)
            finally:
                counter.in_read -= 1
        return read

    interpreter.InterpretedFunction.run = launching(saved_run)
    jit.JITFunction.run = launching(saved_jit)  # compiled kernels (a GPU)
    for name, fn in saved_reads.items():
        setattr(torch.Tensor, name, reading(name, fn))
    try:
        with counter:
            yield counter
    finally:
        interpreter.InterpretedFunction.run = saved_run
        jit.JITFunction.run = saved_jit
        for name, fn in saved_reads.items():
            setattr(torch.Tensor, name, fn)


def count_call(fn):
    """(launches, host reads, counter) of fn() (which runs forward and backward)."""
    with counting() as c:
        fn()
    return c.launches, c.host_reads, c


def batch(B, T, seed, packed, V=24, device="cpu"):
    """(logits, ids, advantages, mask, extras) of a random batch: peaked logits (mean entropies on both sides
    of GTPO's filter), old / ref log-probs near the policy's, conflict weights given; packed: the counted
    tokens of each row as a completion (cu_seqlens, max_seqlen in extras)."""
    from gtpo_kernels import conflict_weights
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    adv = torch.randn(B, generator=g)
    lam, n_conf = conflict_weights(ids, mask, adv, 4)
    logits = torch.randn(B, T, V, generator=g) * 6
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    kw = dict(old_logps=logp + torch.randn(B, T, generator=g) * 0.1, ref_logps=logp + torch.randn(B, T, generator=g) * 0.1,
              lam=lam, n_conf=n_conf)
    if packed:
        lengths = mask.sum(1)
        keep = mask.reshape(-1)
        kw = {k: v.reshape(-1)[keep] if v.dim() == 2 else v for k, v in kw.items()}
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        out = (logits.reshape(B * T, V)[keep], ids.reshape(-1)[keep], adv, None,
               dict(kw, cu_seqlens=cu, max_seqlen=int(lengths.max())))
    else:
        out = logits, ids, adv, mask, kw
    if device == "cpu":
        return out
    move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    return (*[move(x) for x in out[:4]], {k: move(v) for k, v in out[4].items()})


def _rows(device="cpu"):
    """(name, prepare) of every call of the table: prepare() makes the inputs (outside the count) and
    returns the call (forward + backward, or token_logprobs' forward)."""
    from gtpo_kernels import GTPOConfig, gtpo_loss, token_logprobs

    def loss(packed=False, drop=(), **kw):
        def prepare():
            logits, ids, adv, mask, extra = batch(8, 6, 0, packed, device=device)
            extra = {k: v for k, v in extra.items() if k not in drop}
            x = logits.requires_grad_()
            return lambda: gtpo_loss(x, ids, adv, mask, backend="triton", **extra, **kw).loss.backward()
        return prepare

    def logps(validate, packed=False, per_token_tau=False, per_completion_tau=False, **rules):
        def prepare():
            logits, ids, _, mask, extra = batch(8, 6, 0, packed, device=device)
            kw = dict(cu_seqlens=extra["cu_seqlens"]) if packed else dict(completion_mask=mask)
            shape = ids.shape if per_token_tau else (8,) if per_completion_tau else None
            tau = torch.rand(shape, generator=torch.Generator().manual_seed(1)).to(device) + 0.5 if shape else 0.7
            return lambda: token_logprobs(logits, ids, tau, validate=validate, backend="triton", **kw, **rules)
        return prepare

    def token_mode(mode):
        """verl's policy loss `gtpo_<mode>` (integrations/verl_modes.py) on per-token advantages; verl's
        agg_loss stands as a plain sum, its clip fraction is read on the host (verl's metrics are floats)."""
        def prepare():
            import types

            from gtpo_kernels.integrations.verl_modes import mode_loss
            _, _, _, mask, extra = batch(8, 6, 0, False, device=device)
            g = torch.Generator().manual_seed(2)
            old = extra["old_logps"]
            lp = (old + 0.1 * torch.randn(old.shape, generator=g).to(device)).requires_grad_()
            adv = torch.randn(old.shape, generator=g).to(device)
            mask = mask.long()  # verl's response_mask: the attention mask's int64 slice, made before the loss
            pl = types.SimpleNamespace(clip_cov_ratio=0.2, clip_cov_lb=1.0, clip_cov_ub=5.0)
            actor = type("Actor", (dict,), dict(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=0.28,
                                                policy_loss=pl))()
            agg = lambda loss_mat, loss_mask, loss_agg_mode: loss_mat.sum()  # noqa: E731
            return lambda: mode_loss(mode, old, lp, adv, mask, "token-mean", actor, None, agg,
                                     backend="triton")[0].backward()
        return prepare

    def head_inputs():
        """The head rows' batch: 16 completions x 8 tokens, D = 16, V = 64 (h and w require grad)."""
        g = torch.Generator().manual_seed(0)
        B, T, D, V = 16, 8, 16, 64
        h = torch.randn(B, T, D, generator=g).to(device).requires_grad_()
        w = torch.randn(V, D, generator=g).to(device).requires_grad_()
        return h, w, torch.randint(0, V, (B, T), generator=g).to(device), torch.randn(B, generator=g).to(device)

    def head(schedule, tiles):
        def prepare():
            from gtpo_kernels import linear_gtpo_loss
            from gtpo_kernels.pipeline.head import row_bytes
            h, w, ids, adv = head_inputs()
            budget = (ids.numel() // tiles) * row_bytes(w.shape[0], torch.float32, h.device)
            return lambda: linear_gtpo_loss(h, w, ids, adv, group_size=4, config="grpo", validate=False,
                                            backend="triton", memory_budget=budget,
                                            schedule=schedule).loss.backward()
        return prepare

    def head_logprobs(validate):
        def prepare():
            from gtpo_kernels import linear_token_logprobs
            h, w, ids, _ = head_inputs()
            return lambda: linear_token_logprobs(h.detach(), w.detach(), ids, 1.0, validate=validate,
                                                 backend="triton")
        return prepare

    def head_sets(validate, budget=None):
        """budget: a memory_budget cutting the 128 tokens' kept sets (5 or 6 ids) into union tiles (None: one)."""
        def prepare():
            from gtpo_kernels import linear_gtpo_loss
            h, w, ids, adv = head_inputs()
            top = (h.detach() @ w.detach().t()).topk(5, -1).indices.reshape(ids.numel(), 5).tolist()
            sets = [sorted(set(k) | {int(y)}) for k, y in zip(top, ids.reshape(-1).tolist())]
            offsets = torch.tensor([0] + [len(k) for k in sets]).cumsum(0).to(device)
            kept = (torch.tensor([v for k in sets for v in k], device=device), offsets)
            extra = {} if budget is None else dict(memory_budget=budget)
            return lambda: linear_gtpo_loss(h, w, ids, adv, group_size=4, config="grpo", validate=validate,
                                            backend="triton", sampling_mask=kept, **extra).loss.backward()
        return prepare

    def head_rules(budget=None):
        def prepare():
            from gtpo_kernels import linear_gtpo_loss
            h, w, ids, adv = head_inputs()
            extra = {} if budget is None else dict(memory_budget=budget)
            return lambda: linear_gtpo_loss(h, w, ids, adv, group_size=4, config="grpo", validate=False,
                                            backend="triton", top_k=5, top_p=0.9, **extra).loss.backward()
        return prepare

    def from_logps(validate):
        def prepare():
            from gtpo_kernels import gtpo_loss_from_logps
            logits, ids, adv, mask, extra = batch(8, 6, 0, False, device=device)
            extra.pop("ref_logps")
            logp_all = torch.log_softmax(logits, -1)
            lp = logp_all.gather(-1, ids[..., None])[..., 0].requires_grad_()
            H = -(logp_all.exp() * logp_all).sum(-1)
            return lambda: gtpo_loss_from_logps(lp, ids, adv, mask, entropy=H, validate=validate, backend="triton",
                                                **extra).loss.backward()
        return prepare

    def recorded_sets(validate):
        def prepare():
            logits, ids, adv, mask, extra = batch(8, 6, 0, False, device=device)
            extra.pop("ref_logps")
            top = logits[mask].topk(5, -1).indices  # each counted row's top 5 ids and its sampled id
            sets = [sorted(set(r.tolist()) | {int(y)}) for r, y in zip(top, ids[mask])]
            offsets = torch.tensor([0] + [len(k) for k in sets]).cumsum(0).to(logits.device)
            kept = (torch.tensor([v for k in sets for v in k], device=logits.device), offsets)
            x = logits.requires_grad_()
            return lambda: gtpo_loss(x, ids, adv, mask, sampling_mask=kept, validate=validate, backend="triton",
                                     **extra).loss.backward()
        return prepare
    no_ref = ("ref_logps",)
    return [("gtpo_loss, gtpo, lam given, validate=False", loss(validate=False, drop=no_ref)),
            ("the same, validate=True", loss(validate=True, drop=no_ref)),
            ("grpo with beta and ref_logps, validate=False",
             loss(validate=False, config=GTPOConfig.preset("grpo", beta=0.04), drop=("lam", "n_conf"))),
            ("conflict weights computed in the call", loss(validate=False, group_size=4,
                                                           drop=("lam", "n_conf", "ref_logps"))),
            ("packed with max_seqlen, validate=False", loss(packed=True, validate=False, drop=no_ref)),
            ("packed without max_seqlen, validate=False", loss(packed=True, validate=False,
                                                               drop=("ref_logps", "max_seqlen"))),
            ("packed, validate=True", loss(packed=True, validate=True, drop=no_ref)),
            ("per-completion temperature, validate=False",
             loss(validate=False, drop=no_ref, temperature=torch.full((8, 1), 0.7, device=device))),
            ("cispo", loss(validate=False, config="cispo", drop=no_ref)),
            ("top_k replay, validate=True", loss(validate=True, top_k=5, drop=no_ref)),
            ("token_logprobs, validate=False", logps(False)),
            ("token_logprobs, validate=True", logps(True)),
            ("linear_gtpo_loss, fused schedule, 4 tiles", head("fused", 4)),
            ("the same, 16 tiles", head("fused", 16)),
            ("linear_gtpo_loss, recompute schedule, 4 tiles", head("recompute", 4)),
            ("the same, 16 tiles", head("recompute", 16)),
            ("linear_token_logprobs, one tile, validate=False", head_logprobs(False)),
            ("the same, validate=True", head_logprobs(True)),
            ("linear_gtpo_loss over recorded kept sets, validate=False", head_sets(False)),
            ("the same, validate=True", head_sets(True)),
            ("the same, validate=False, 4 union tiles", head_sets(False, 8 * 32 * 64)),
            ("the same, validate=False, 16 union tiles", head_sets(False, 8 * 8 * 48)),
            ("linear_gtpo_loss with top_k and top_p (the sets rebuilt per tile), validate=False", head_rules()),
            ("the same, 4 tiles (forward: of the vocabulary; backward: union tiles)", head_rules(8 * 32 * 64)),
            ("gtpo_loss_from_logps, validate=False", from_logps(False)),
            ("the same, validate=True", from_logps(True)),
            ("sampling_mask replay (recorded sets), validate=False", recorded_sets(False)),
            ("the same, validate=True", recorded_sets(True)),
            ("top_k replay, validate=False", loss(validate=False, top_k=5, drop=no_ref)),
            ("token_logprobs packed, validate=True", logps(True, packed=True)),
            ("token_logprobs, a temperature per token, validate=True", logps(True, per_token_tau=True)),
            ("token_logprobs packed, a temperature per completion, validate=False",
             logps(False, packed=True, per_completion_tau=True)),
            ("the same, validate=True", logps(True, packed=True, per_completion_tau=True)),
            ("rollout_is_weights per token, validate=False",
             loss(validate=False, drop=no_ref, rollout_is_weights=torch.rand(8, 6, device=device) + 0.5)),
            ("rollout_is_weights per completion (B, 1), validate=False",
             loss(validate=False, drop=no_ref, rollout_is_weights=torch.rand(8, 1, device=device) + 0.5)),
            ("the same, validate=True",
             loss(validate=True, drop=no_ref, rollout_is_weights=torch.rand(8, 1, device=device) + 0.5)),
            ("off-policy mask (off_policy_mask_threshold), validate=False",
             loss(validate=False, drop=no_ref, config=GTPOConfig(off_policy_mask_threshold=0.05))),
            ("top-entropy mask (top_entropy_quantile=0.2), validate=False",
             loss(validate=False, drop=no_ref, config=GTPOConfig(top_entropy_quantile=0.2))),
            ("beta as a tensor (a schedule), validate=False",
             loss(validate=False, drop=("lam", "n_conf"),
                  config=GTPOConfig.preset("grpo", beta=torch.tensor(0.04, device=device)))),
            ("beta, eps_low (float64), eps_high, entropy_coef as tensors, validate=False",
             loss(validate=False, drop=("lam", "n_conf"),
                  config=GTPOConfig.preset("grpo", beta=torch.tensor(0.04, device=device),
                                           eps_low=torch.tensor(0.2, dtype=torch.float64, device=device),
                                           eps_high=torch.tensor(0.28, device=device),
                                           entropy_coef=torch.tensor(0.01, device=device)))),
            ("initial_entropy as a device tensor (no .item()), validate=False",
             loss(validate=False, drop=no_ref,
                  config=GTPOConfig(initial_entropy=torch.tensor(0.5, device=device)))),
            ("vespo", loss(validate=False, config="vespo", drop=no_ref)),
            ("geo_mean (verl's GMPO)", loss(validate=False, drop=no_ref,
                                            config=GTPOConfig.preset("geo-mean", loss_agg="seq-mean-token-mean"))),
            ("clip_cov (verl)", loss(validate=False, config="clip-cov", drop=no_ref)),
            ("kl_cov (verl)", loss(validate=False, config="kl-cov", drop=no_ref)),
            ("gtpo with clip_cov's policy term, the top-entropy mask and conflict weights computed in the call",
             loss(validate=False, group_size=4, drop=("lam", "n_conf", "ref_logps"),
                  config=GTPOConfig.preset("gtpo", policy_loss="clip-cov", top_entropy_quantile=0.5))),
            ("top_k, top_p and min_p replay, validate=False",
             loss(validate=False, top_k=5, top_p=0.9, min_p=0.01, drop=no_ref)),
            ("token_logprobs with top_k and top_p, validate=False", logps(False, top_k=5, top_p=0.9)),
            ("the same, validate=True", logps(True, top_k=5, top_p=0.9)),
            ("inplace=True (the gradient over the logits), validate=False", loss(validate=False, inplace=True,
                                                                                  drop=no_ref)),
            ("verl's gtpo_vanilla on token advantages (its agg_loss: a sum here)", token_mode("vanilla")),
            ("verl's gtpo_clip_cov on token advantages (the same)", token_mode("clip_cov")),
            ("verl's gtpo_geo_mean on token advantages (the same)", token_mode("geo_mean"))]


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(prog="python -m bench.launches", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu (Triton's interpreter) or cuda (default: cpu)")
    args = ap.parse_args(argv)
    print(f"| call (forward + backward; Triton backend, {args.device}) | launches | of them Triton | host reads "
          "| tensors from host data |")
    print("|---|---|---|---|---|")
    for name, prepare in _rows(args.device):
        prepare()()  # once first: a compiled kernel's first launch compiles it
        run = prepare()
        with counting() as c:
            run()
        print(f"| {name} | {c.launches} | {c.triton} | {c.host_reads} | {c.creations} |")


if __name__ == "__main__":
    if "--device" not in " ".join(os.sys.argv) or "cpu" in os.sys.argv:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from bench import interpreter
        interpreter.install()  # counts, not times: the interpreter's repeated patching only costs minutes
    main()
