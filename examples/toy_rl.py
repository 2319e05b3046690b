"""Toy RL run: GTPO against GRPO on a task with a fixed answer format, on the CPU (its JSON records the
run time, with the date, commit, machine and load).

    python examples/toy_rl.py                  # writes toy_rl_out/; one line per seed and arm
    python examples/toy_rl.py --verbose        # also one line per step
    python examples/toy_rl.py --steps 10 --seeds 0 --out /tmp/demo     # a quick look

The task (a miniature of the GTPO paper's math prompts): the prompt is `a ? b =` with digits a, b, where
the operator token asks for the larger of the two;
a completion is free text over a small vocabulary, and the expected form is `<a> d </a> <eos>`, the
answer digit d between opening and closing tags. Reward = format part + correctness part, as the
paper's: 0.5 when the completion is exactly well formed, plus 1.0 when it is well formed and
d = max(a, b). So every completion of a group shares the tags, and only some answers are right:
the tags are the "conflict tokens" that GRPO pushes down in the wrong completions and up in the
right ones, and that GTPO protects (negative updates skipped, positive ones doubled).

The policy is a one-layer GRU (no transformers needed). A short supervised warm-up on well-formed
completions with random digits (identical for both arms: one warm-started checkpoint) teaches some of
the format, not the answer. Then both arms run the same number of on-policy steps from the same
weights with the same seeds, the same optimizer and the same group advantages rule; they differ only
in the loss preset: 'gtpo' (conflict weights, entropy filter and penalty) or 'grpo'. Outputs: one
line per seed and arm (`--verbose`: per step), and in `--out` (default `toy_rl_out/` in the current directory)
`toy_rl.json` with every curve (per seed and mean over seeds) and `toy_rl.png` (reward, format
accuracy, conflict-token fraction and mean entropy against step, both arms). The figure in
docs/trainers.md, bench/results/toy_rl/toy_rl.png, is a default run with `--out bench/results/toy_rl`.

The conflict-token fraction is measured on each arm's own samples with `conflict_weights` (counted
tokens whose lambda would differ from 1); GRPO's loss does not use it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn as nn

from gtpo_kernels import GTPOConfig, conflict_weights, gtpo_loss, token_logprobs

# vocabulary: digits 0-9, then symbols
PLUS, EQ, OPEN, CLOSE, EOS, FILL = 10, 11, 12, 13, 14, 15
V = 16
NAMES = [str(d) for d in range(10)] + ["+", "=", "<a>", "</a>", "<eos>", "~"]
PROMPT_LEN = 4  # a + b =


class TinyPolicy(nn.Module):
    """Embedding -> GRU -> linear head over the vocabulary."""

    def __init__(self, hidden=64):
        super().__init__()
        self.emb = nn.Embedding(V, hidden)
        self.rnn = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, V)

    def forward(self, tokens, h=None):
        y, h = self.rnn(self.emb(tokens), h)
        return self.head(y), h


def make_prompts(n, gen):
    ab = torch.randint(0, 10, (n, 2), generator=gen)
    prompts = torch.stack([ab[:, 0], torch.full((n,), PLUS), ab[:, 1], torch.full((n,), EQ)], 1)
    return prompts, torch.maximum(ab[:, 0], ab[:, 1])


@torch.no_grad()
def sample(policy, prompts, max_len, gen, temperature=1.0):
    """Completions (B, max_len) and their mask (tokens up to and including the first <eos>)."""
    logits, h = policy(prompts)
    last = logits[:, -1]
    out = []
    done = torch.zeros(prompts.size(0), dtype=torch.bool)
    for _ in range(max_len):
        probs = torch.softmax(last / temperature, -1)
        tok = torch.multinomial(probs, 1, generator=gen)[:, 0]
        tok = torch.where(done, torch.full_like(tok, EOS), tok)
        out.append(tok)
        done |= tok == EOS
        logits, h = policy(tok[:, None], h)
        last = logits[:, -1]
    comp = torch.stack(out, 1)
    is_eos = comp == EOS
    mask = (is_eos.cumsum(1) - is_eos.long()) == 0
    return comp, mask


def score(comp, mask, target):
    """(reward, well_formed, correct) per completion: format 0.5, correctness 1.0."""
    n = mask.sum(1)
    well = (n == 4) & (comp[:, 0] == OPEN) & (comp[:, 1] < 10) & (comp[:, 2] == CLOSE) & (comp[:, 3] == EOS)
    correct = well & (comp[:, 1] == target)
    return 0.5 * well.float() + 1.0 * correct.float(), well, correct


def group_advantages(rewards, G):
    r = rewards.view(-1, G)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


def warm_up(policy, steps, batch, lr, gen):
    """Supervised steps on `<a> d </a> <eos>` with a random digit d (the format, not the answer)."""
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    for _ in range(steps):
        prompts, _ = make_prompts(batch, gen)
        d = torch.randint(0, 10, (batch,), generator=gen)
        comp = torch.stack([torch.full((batch,), OPEN), d, torch.full((batch,), CLOSE),
                            torch.full((batch,), EOS)], 1)
        logits, _ = policy(torch.cat([prompts, comp[:, :-1]], 1))
        loss = nn.functional.cross_entropy(logits[:, PROMPT_LEN - 1:].reshape(-1, V), comp.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def run_arm(arm, init_state, args, seed, log):
    policy = TinyPolicy(args.hidden)
    policy.load_state_dict(init_state)
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1000 + seed)  # same sampling seed for both arms
    G = args.group_size
    config = None
    curves = {k: [] for k in ("reward", "format_acc", "answer_acc", "conflict_frac", "mean_entropy",
                              "filtered_frac", "clip_frac")}
    for step in range(args.steps):
        prompts, target = make_prompts(args.prompts, gen)
        prompts = prompts.repeat_interleave(G, 0)          # groups: G contiguous rows per prompt
        target = target.repeat_interleave(G, 0)
        comp, mask = sample(policy, prompts, args.max_len, gen)
        rewards, well, correct = score(comp, mask, target)
        adv = group_advantages(rewards, G)
        lam, n_conf = conflict_weights(comp, mask, adv, G)  # at advantage time, on whole groups
        seqs = torch.cat([prompts, comp], 1)
        if config is None:
            if arm == "gtpo":
                with torch.no_grad():
                    _, ent = token_logprobs(policy(seqs)[0], comp, 1.0, mask, logits_start=PROMPT_LEN - 1)
                h0 = (ent.sum() / mask.sum()).item()  # the paper's gate: the starting policy's entropy
                config = GTPOConfig.preset("gtpo", initial_entropy=h0)
            else:
                config = GTPOConfig.preset("grpo")
        logits, _ = policy(seqs)                            # (B, 4 + T, V); row 3 + t predicts token t
        out = gtpo_loss(logits, comp, adv, mask, config=config, logits_start=PROMPT_LEN - 1,
                        lam=lam if config.use_conflict_mask else None,
                        n_conf=n_conf if config.use_conflict_mask else None)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()

        m = mask.float()
        vals = dict(reward=rewards.mean().item(), format_acc=well.float().mean().item(),
                    answer_acc=correct.float().mean().item(),
                    conflict_frac=(((lam != 1).float() * m).sum() / m.sum()).item(),
                    mean_entropy=out.metrics["mean_entropy"].item(),
                    filtered_frac=out.metrics["filtered_frac"].item(),
                    clip_frac=out.metrics["clip_frac"].item())
        for k, v in vals.items():
            curves[k].append(v)
        log(f"{arm:4s} seed {seed} step {step:3d} | reward {vals['reward']:.3f} | format {vals['format_acc']:.3f} | "
            f"correct {vals['answer_acc']:.3f} | conflict {vals['conflict_frac']:.3f} | "
            f"entropy {vals['mean_entropy']:.3f} | filtered {vals['filtered_frac']:.3f}")
    return curves


def _mean(curves_per_seed):
    keys = curves_per_seed[0].keys()
    return {k: [sum(c[k][i] for c in curves_per_seed) / len(curves_per_seed)
                for i in range(len(curves_per_seed[0][k]))] for k in keys}


def _tail(xs, n=10):
    xs = xs[-n:]
    return sum(xs) / len(xs)


def plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib); the JSON has every curve")
        return False
    panels = [("reward", "reward"), ("format_acc", "format accuracy"),
              ("conflict_frac", "conflict-token fraction"), ("mean_entropy", "mean token entropy (nats)")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    colors = {"gtpo": "tab:blue", "grpo": "tab:orange"}
    for ax, (key, title) in zip(axes, panels):
        for arm, data in result["arms"].items():
            for c in data["per_seed"]:
                ax.plot(c[key], color=colors[arm], alpha=0.25, lw=0.8)
            ax.plot(data[key], color=colors[arm], lw=2, label=arm.upper())
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    a = result["args"]
    fig.suptitle(f"toy RL: GTPO vs GRPO, {len(a['seeds'])} seed(s) (thin: each seed, thick: mean), "
                 f"{a['prompts']}x{a['group_size']} completions per step", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def provenance():
    """Date, commit (+dirty), machine and load of this run, as the benchmark records them."""
    here = Path(__file__).resolve().parent

    def git(*a):
        r = subprocess.run(["git", *a], cwd=here, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None
    commit = git("rev-parse", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                   cpu)
    return dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), commit=commit,
                machine=dict(cpu=cpu, cpu_count=os.cpu_count(), torch=torch.__version__))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python examples/toy_rl.py",
                                description="GTPO vs GRPO on a toy task with a fixed answer format (CPU)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="RL steps per arm")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="one run per seed and arm")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--max-len", type=int, default=6, help="completion length cap")
    p.add_argument("--warmup-steps", type=int, default=20, help="supervised format warm-up steps")
    p.add_argument("--hidden", type=int, default=64, help="GRU width")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--out", default="toy_rl_out",
                   help="folder for toy_rl.json and toy_rl.png, relative to the current directory")
    p.add_argument("--verbose", action="store_true", help="also print one line per step")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # tiny ops: one thread is fastest, and steady on a busy machine
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = (lambda s: print(s, flush=True)) if args.verbose else (lambda s: None)

    t0, load_before, prov = time.time(), os.getloadavg()[0], provenance()  # the tree as the run starts
    arms = {"gtpo": [], "grpo": []}
    for seed in args.seeds:
        torch.manual_seed(seed)
        policy = TinyPolicy(args.hidden)
        warm_up(policy, args.warmup_steps, 64, args.lr, torch.Generator().manual_seed(seed))
        init = {k: v.clone() for k, v in policy.state_dict().items()}
        for arm in arms:
            c = run_arm(arm, init, args, seed, log)
            arms[arm].append(c)
            print(f"{arm:4s} seed {seed}: last {min(10, args.steps)} steps reward {_tail(c['reward']):.3f}, "
                  f"format {_tail(c['format_acc']):.3f}, correct {_tail(c['answer_acc']):.3f}", flush=True)
    result = {"task": "a+b= -> '<a> max(a,b) </a> <eos>'; reward 0.5 format + 1.0 correct",
              **prov, "load": dict(before=load_before, after=os.getloadavg()[0]),
              "args": vars(args), "seconds": None, "arms": {}}
    for arm, per_seed in arms.items():
        result["arms"][arm] = {**_mean(per_seed), "per_seed": per_seed}
    result["seconds"] = round(time.time() - t0, 1)
    (out / "toy_rl.json").write_text(json.dumps(result))
    png = plot(result, out / "toy_rl.png")

    print(f"\nfinal (mean over seeds {args.seeds}, last {min(10, args.steps)} steps), {result['seconds']} s:")
    for arm in arms:
        a = result["arms"][arm]
        print(f"  {arm.upper():4s} reward {_tail(a['reward']):.3f} | format {_tail(a['format_acc']):.3f} | "
              f"correct {_tail(a['answer_acc']):.3f} | conflict {_tail(a['conflict_frac']):.3f} | "
              f"entropy {_tail(a['mean_entropy']):.3f}")
    print(f"wrote {out / 'toy_rl.json'}" + (f" and {out / 'toy_rl.png'}" if png else ""))
    return result


if __name__ == "__main__":
    main()
