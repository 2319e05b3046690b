"""The TRL adapter with 2 processes equals 1 process (issue 11, item 3).

GTPOTrainer trains one step with 2 CPU processes (torch.distributed gloo, DDP through accelerate: the
workers are forked with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set) and with 1 process,
on the same global batch: 3 prompts x num_generations 4 = 12 completions, 6 per process, so that the middle
group straddles the processes and its conflict weights need conflict_weights(process_group=...).
Generation is replaced by a fixed completion per row of the global batch (TRL's sampler gives both runs
the same prompt order; rank r holds rows 6r..6r+5) and the reward is a rule, so both runs see the same
completions, rewards and advantages. Compared, for the loss types 'grpo'
(per-completion means: DDP's average over 2 processes of 6 equals 1 process's mean over 12) and 'dapo'
(the global token count num_items_in_batch): the batch TRL built, the conflict weights, the gradient
all-reduced by DDP just before the optimizer step, and the parameters after one SGD step (lr 1, no
clipping: the update is the gradient itself, so the comparison sees its scale, as Adam's first step,
about lr * sign(g), would not).
"""
import importlib.util
import os
import socket
import time
import traceback

import pytest
import torch

import gtpo_kernels
from trl_setup import needs_trl, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                                reason="TRL is not installed: pip install 'gtpo-kernels[trl]'")

G = 4                                  # num_generations
PROMPTS = ["1+2=", "3+4=", "5+1="]     # 3 groups: rows 0-3, 4-7 (straddles ranks 0 | 1), 8-11
LOSS_TYPES = ("grpo", "dapo")
# the completion of global row i (rank r holds rows 6r..6r+5; <eos> ends it, else it is cut at 8 tokens).
# Shared prefixes ("1", "12", "3", "34", "7") in completions of both advantage signs make conflict tokens;
# rank 0's longest completion has 8 tokens, rank 1's 5, so the ranks pad to different T.
COMPLETIONS = ["12ab<eos>", "12a3x7yz", "1b<eos>", "12a4<eos>",      # group 0: rewards 2 4 1 3
               "34x<eos>", "3ab<eos>", "3456<eos>", "34<eos>",        # group 1 (straddles): 2 1 4 2
               "7<eos>", "78<eos>", "7c<eos>", "789<eos>"]            # group 2: 1 2 1 3


def _completion_ids(tok, row):
    text, out = COMPLETIONS[row], []
    while text:
        n = 5 if text.startswith("<eos>") else 1
        out.append(tok.convert_tokens_to_ids(text[:n]))
        text = text[n:]
    return out[:8]


def reward_digits(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def _run(world_size, rank, out_dir, loss_type):
    """One GTPOTrainer step on this process; returns what the test compares."""
    from datasets import Dataset
    from transformers import TrainerCallback

    from gtpo_kernels.integrations.trl import GTPOTrainer, GTPOTrainerConfig

    tok = tiny_tokenizer()
    seen = {"lam": [], "batch": [], "prompts": []}

    class FixedGeneration(GTPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *a, **k):
            # TRL's global batch is the processes' rows in rank order, groups of G consecutive rows
            start = self.accelerator.process_index * len(prompt_ids)
            texts = tok.batch_decode(prompt_ids)
            seen["prompts"] += texts
            return [_completion_ids(tok, start + i) for i in range(len(texts))], None

        def _gtpo_conflict_weights(self, batch, group_size):
            lam, n_conf = super()._gtpo_conflict_weights(batch, group_size)
            seen["lam"].append(lam.clone())
            seen["batch"].append({k: batch[k].clone() for k in ("completion_ids", "completion_mask", "advantages")})
            return lam, n_conf

    grads = {}

    class GradSpy(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})

    model = tiny_model(len(tok), seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = GTPOTrainerConfig(
        output_dir=os.path.join(out_dir, f"out{world_size}_{rank}_{loss_type}"), use_cpu=True, report_to=[],
        per_device_train_batch_size=len(PROMPTS) * G // world_size, gradient_accumulation_steps=1,
        num_generations=G, max_completion_length=8, max_steps=1, logging_steps=1, save_strategy="no",
        optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", max_grad_norm=0.0, seed=0,
        temperature=1.0, bf16=False, loss_type=loss_type, gtpo_loss="gtpo",
        # the tiny random model's entropy is ~3.4 nats: a threshold above it keeps every token counted
        gtpo_kwargs={"entropy_threshold": 5.0, "conflict_neg_weight": 0.5}, dataloader_num_workers=0)
    tr = FixedGeneration(model=model, reward_funcs=reward_digits, args=args,
                         train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok,
                         callbacks=[GradSpy()])
    assert tr.accelerator.num_processes == world_size and tr.accelerator.process_index == rank
    from gtpo_kernels.kernels import dispatch
    orig, kernel = dispatch.vocab_fwd, {"vocab_fwd": 0}

    def spy(*a, **k):  # our fused vocabulary kernel
        kernel["vocab_fwd"] += 1
        return orig(*a, **k)
    dispatch.vocab_fwd = spy
    try:
        tr.train()
    finally:
        dispatch.vocab_fwd = orig
    after = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    return {"grads": grads, "update": {n: after[n] - before[n] for n in after}, "lam": seen["lam"],
            "batch": seen["batch"], "prompts": seen["prompts"], "gtpo_calls": tr._gtpo_calls,
            "vocab_fwd": kernel["vocab_fwd"],
            "ddp": type(tr.model_wrapped).__name__}


def _worker(rank, port, out_dir):
    """A forked process of the 2-process run: a fresh accelerate state, gloo through the env vars."""
    try:
        torch.set_num_threads(1)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        from accelerate.state import AcceleratorState, GradientState, PartialState
        # the singletons may hold the parent's (pytest's) one-process state
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
        res = {lt: _run(2, rank, out_dir, lt) for lt in LOSS_TYPES}
    except Exception:
        res = {"exception": traceback.format_exc()}
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _flat(d):
    return torch.cat([v.flatten().double() for _, v in sorted(d.items())])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch.multiprocessing as mp

    from gtpo_kernels.integrations import trl  # noqa: F401  (imported once here; the forked workers inherit it)
    tmp = str(tmp_path_factory.mktemp("trl_mp"))
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # fork, not spawn: a spawned process spends seconds importing TRL; no process group exists here
        ctx = mp.start_processes(_worker, args=(_free_port(), tmp), nprocs=2, join=False, start_method="fork")
        deadline = time.monotonic() + 180  # a rank left waiting in a collective must not hang the suite
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail("the 2-process TRL run did not finish in 180 s")
        two = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(2)]
        for r, res in enumerate(two):
            assert "exception" not in res, f"rank {r}:\n{res['exception']}"
        one = {lt: _run(1, 0, tmp, lt) for lt in LOSS_TYPES}
    finally:
        torch.set_num_threads(n)
    return one, two


def gtpo_cfg(loss_type):
    """The conflict-weight fields of the trainers' GTPOConfig."""
    import gtpo_kernels
    return gtpo_kernels.GTPOConfig.preset(loss_type, use_conflict_mask=True, conflict_neg_weight=0.5)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_trl_two_processes_equal_one(runs, loss_type):
    one, two = runs[0][loss_type], [r[loss_type] for r in runs[1]]
    assert one["ddp"] != "DistributedDataParallel"
    assert all(t["ddp"] == "DistributedDataParallel" for t in two), [t["ddp"] for t in two]

    # the same global batch: prompts in the same order, rank r holding rows 6r..6r+5, each rank padded to
    # its own longest completion
    assert one["prompts"] == two[0]["prompts"] + two[1]["prompts"]
    assert sorted(one["prompts"][::G]) == sorted(PROMPTS) and all(len(set(one["prompts"][g:g + G])) == 1
                                                                 for g in range(0, len(one["prompts"]), G))
    assert len(set(one["prompts"][4:8])) == 1  # the straddling group: one prompt on both ranks
    ref_b, ref_lam = one["batch"][0], one["lam"][0]
    T_r = [t["batch"][0]["completion_ids"].size(1) for t in two]
    assert T_r[0] != T_r[1]  # different padding per process
    for r, t in enumerate(two):
        b, rows, T = t["batch"][0], slice(6 * r, 6 * r + 6), T_r[r]
        assert torch.equal(b["completion_ids"], ref_b["completion_ids"][rows, :T]), r
        assert torch.equal(b["completion_mask"], ref_b["completion_mask"][rows, :T]), r
        assert torch.allclose(b["advantages"], ref_b["advantages"][rows], rtol=1e-6, atol=1e-6), r
        assert (ref_b["completion_mask"][rows, T:] == 0).all()
        # the conflict weights: gathered over both processes, equal to one process's, row for row
        assert torch.equal(t["lam"][0], ref_lam[rows, :T]), r
    m = ref_b["completion_mask"].bool()
    assert (ref_lam[m] != 1).any() and len(set(ref_lam[m].tolist())) == 3  # 2.0, 0.5 on conflicts, 1.0 elsewhere
    # the straddling group has conflict weights, and on its own half (rows 4, 5: both advantages negative)
    # rank 0 would see none: the weights need rank 1's rows
    assert (ref_lam[4:8][m[4:8]] != 1).any()
    from gtpo_kernels import conflict_weights
    half = conflict_weights(two[0]["batch"][0]["completion_ids"][4:6], two[0]["batch"][0]["completion_mask"][4:6],
                            two[0]["batch"][0]["advantages"][4:6], 2, config=gtpo_cfg(loss_type))[0]
    assert not torch.equal(half, two[0]["lam"][0][4:6])

    # our loss ran (one linear_gtpo_loss call per process for the step) through our vocabulary kernel
    assert one["gtpo_calls"] == 1 and all(t["gtpo_calls"] == 1 for t in two)
    assert one["vocab_fwd"] >= 1 and all(t["vocab_fwd"] >= 1 for t in two)

    # DDP's all-reduced gradient equals one process's gradient, and both ranks take the same step
    g1 = _flat(one["grads"])
    assert g1.norm() > 0
    for t in two:
        assert _rel(_flat(t["grads"]), g1) < 1e-5, (loss_type, _rel(_flat(t["grads"]), g1))
        assert _rel(_flat(t["update"]), _flat(one["update"])) < 1e-5
    assert torch.equal(_flat(two[0]["update"]), _flat(two[1]["update"]))
    # the update is the gradient (SGD, lr 1, no clipping)
    assert _rel(-_flat(one["update"]), g1) < 1e-5


# ---------------------------------------------------------------- TRL with several processes: conflict weights

# TRL gives process r the rows r * B .. (r + 1) * B of the generation batch, padded to that process's
# longest completion: 3 groups of 4 over 2 processes of 6 rows (group 1, rows 4..7, straddles them),
# process 0 padded to T = 7, process 1 to T = 5
_DP_G, _DP_B, _DP_T = 4, 6, (7, 5)


def _dp_batch():
    """The whole batch (12 completions, padded to 7) as TRL's keys, and the GTPOConfig."""
    g = torch.Generator().manual_seed(0)
    B, T = 2 * _DP_B, max(_DP_T)
    lens = torch.cat([torch.randint(1, T_r + 1, (_DP_B,), generator=g) for T_r in _DP_T])
    lens[0], lens[_DP_B] = _DP_T  # each process's longest completion sets its padding
    mask = (torch.arange(T) < lens[:, None]).long()
    ids = torch.randint(3, 7, (B, T), generator=g) * mask  # a small vocabulary: many shared tokens; pad 0
    tool_mask = torch.ones(B, T, dtype=torch.long)
    tool_mask[5, 0] = tool_mask[6, 1] = 0  # tool-output tokens of the straddling group (not counted)
    adv = torch.tensor([1., -1., .5, 0., 1., -1., -.5, 2., -1., 1., -2., .5])
    cfg = gtpo_kernels.GTPOConfig.preset("gtpo", conflict_neg_weight=0.5)
    return {"completion_ids": ids, "completion_mask": mask, "tool_mask": tool_mask, "advantages": adv}, cfg


def _dp_conflict_worker(rank, init_file, out_dir):
    """One process: the adapter's _gtpo_conflict_weights on a stand-in trainer with this process's slice."""
    import traceback
    from types import MethodType, SimpleNamespace

    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        from gtpo_kernels.integrations.trl import GTPOTrainer
        batch, cfg = _dp_batch()
        rows, T = slice(rank * _DP_B, (rank + 1) * _DP_B), _DP_T[rank]
        local = {k: (v[rows, :T] if v.dim() == 2 else v[rows]) for k, v in batch.items()}
        stand_in = SimpleNamespace(accelerator=SimpleNamespace(num_processes=2, process_index=rank), gtpo_config=cfg)
        lam, n_conf = MethodType(GTPOTrainer._gtpo_conflict_weights, stand_in)(local, _DP_G)
        res = {"lam": lam, "n_conf": n_conf}
    except Exception:
        res = {"exception": traceback.format_exc()}
    torch.save(res, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


@needs_trl
def test_trl_conflict_weights_across_two_processes(tmp_path):
    """With 2 processes (gloo) the adapter's conflict weights, through conflict_weights(process_group=...),
    equal one process's on the whole batch, row for row, with a group straddling the processes and each
    process padded to its own T."""
    import torch.multiprocessing as mp

    from gtpo_kernels.integrations import trl  # noqa: F401  (imported here, the forked processes inherit it)
    # fork, not spawn: a spawned process spends seconds importing TRL; the workers run one thread each
    # (as DataLoader's forked workers) and no process group exists before the fork
    mp.start_processes(_dp_conflict_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    batch, cfg = _dp_batch()
    mask = batch["completion_mask"] * batch["tool_mask"]
    lam_ref, n_ref = gtpo_kernels.conflict_weights(batch["completion_ids"], mask, batch["advantages"], _DP_G,
                                                   config=cfg)
    for rank in range(2):
        res = torch.load(tmp_path / f"{rank}.pt")
        assert "exception" not in res, f"rank {rank}:\n{res.get('exception')}"
        rows, T = slice(rank * _DP_B, (rank + 1) * _DP_B), _DP_T[rank]
        assert res["lam"].shape == (_DP_B, T) and res["n_conf"].shape == (_DP_B,)
        assert torch.equal(res["lam"], lam_ref[rows, :T]), rank
        assert torch.equal(res["n_conf"], n_ref[rows]), rank
    # the straddling group's weights need both processes' rows: its halves alone give other weights
    halves = gtpo_kernels.conflict_weights(batch["completion_ids"][4:8], mask[4:8], batch["advantages"][4:8], 2,
                                           config=cfg)[0]
    assert not torch.equal(halves, lam_ref[4:8])
    assert len(set(lam_ref[mask.bool()].tolist())) == 3  # weights 2.0 and 0.5 on conflict tokens, 1.0 elsewhere
