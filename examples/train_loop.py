"""A complete policy-gradient loop with gtpo_loss and a Hugging Face causal LM: the reference for how
to call gtpo-kernels.

Each step: sample G completions per prompt, score them with a rule-based reward, compute group
advantages and, at that same point, the conflict-token weights; then run the policy on the whole
sequences and hand its logits to gtpo_loss with `logits_start` (no slice, no log_softmax), and step.

The model is a tiny randomly initialised Llama built from a config (no downloads) and the tokenizer
is a character table, so this runs anywhere without downloads (20 steps: about a minute and a half on two
CPU cores); swap in your own model and tokenizer.

    python examples/train_loop.py                      # 20 steps on the CPU
    python examples/train_loop.py --steps 3 --prompts 2 --group-size 4
"""
import argparse
import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gtpo_kernels import GTPOConfig, conflict_weights, gtpo_loss, token_logprobs

# ---- a character-level "tokenizer": ids 0 = pad, 1 = end of sequence
CHARS = "0123456789+="
PAD, EOS = 0, 1
STOI = {c: i + 2 for i, c in enumerate(CHARS)}
ITOS = {i: c for c, i in STOI.items()}


def encode(text):
    return [STOI[c] for c in text]


def decode(ids):
    out = []
    for i in ids:
        if i == EOS:
            break
        out.append(ITOS.get(int(i), "?"))
    return "".join(out)


def reward(prompt, completion):
    """Rule-based: 1 for the right sum, 0.2 for a number that is wrong, 0 otherwise."""
    a, b = int(prompt[0]), int(prompt[2])
    if completion == str(a + b):
        return 1.0
    return 0.2 if completion.isdigit() else 0.0


def main():
    class Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    p = argparse.ArgumentParser(prog="python examples/train_loop.py", description=__doc__, formatter_class=Help)
    p.add_argument("--steps", type=int, default=20, help="training steps (one batch each)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (P)")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=6, help="completion length cap")
    p.add_argument("--updates", type=int, default=2, help="optimizer steps per batch (PPO epochs)")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--seed", type=int, default=0, help="torch seed")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(CHARS) + 2, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        pad_token_id=PAD, bos_token_id=EOS, eos_token_id=EOS))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    G, tau = args.group_size, args.temperature
    config = None  # built at step 0, once the starting policy's entropy is known

    for step in range(args.steps):
        # ---- 1. sample G completions per prompt (groups are contiguous rows: [g*G, (g+1)*G))
        prompts = [f"{random.randint(0, 9)}+{random.randint(0, 9)}=" for _ in range(args.prompts)]
        prompt_ids = torch.tensor([encode(s) for s in prompts])           # (P, Lp), all the same length
        Lp = prompt_ids.size(1)
        model.eval()
        with torch.no_grad():
            seqs = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=True,
                                  temperature=tau, top_k=0, max_new_tokens=args.max_new_tokens,
                                  num_return_sequences=G, pad_token_id=PAD, eos_token_id=EOS)
        completion_ids = seqs[:, Lp:]                                         # (B, T), B = P * G
        # count every token up to and including the first EOS
        is_eos = completion_ids == EOS
        after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0
        mask = ~after_eos
        attention_mask = torch.cat([torch.ones_like(prompt_ids).repeat_interleave(G, 0), mask.long()], 1)

        # ---- 2. rewards and group advantages
        texts = [decode(c) for c in completion_ids.tolist()]
        rewards = torch.tensor([reward(prompts[i // G], t) for i, t in enumerate(texts)])
        r = rewards.view(-1, G)
        advantages = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)

        # ---- 3. conflict weights, on whole groups, at advantage time (before any shuffling or splitting)
        lam, n_conf = conflict_weights(completion_ids, mask, advantages, G)

        # ---- 4. old-policy log-probs for the PPO ratio (forward-only kernel, no autograd)
        model.train()
        with torch.no_grad():
            logits = model(seqs, attention_mask=attention_mask).logits       # (B, Lp + T, V)
            old_logps, entropy = token_logprobs(logits, completion_ids, tau, mask, logits_start=Lp - 1)
        if config is None:
            # The paper's gate: a starting policy more uncertain than h_max = ln 2 (a random model is)
            # switches the entropy filter off instead of filtering out every completion.
            h0 = (entropy.sum() / mask.sum()).item()
            config = GTPOConfig(temperature=tau, initial_entropy=h0)

        # ---- 5. policy-gradient updates on the same batch
        for _ in range(args.updates):
            logits = model(seqs, attention_mask=attention_mask).logits       # (B, Lp + T, V)
            # row Lp - 1 + t predicts completion token t: pass the full logits and say where they start
            # (with HF models, `logits_to_keep=T + 1` and logits_start=0 also works and saves compute)
            out = gtpo_loss(logits, completion_ids, advantages, mask, lam=lam, n_conf=n_conf,
                            old_logps=old_logps, config=config, logits_start=Lp - 1)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        m = {k: v.item() for k, v in out.metrics.items()}
        print(f"step {step:3d} | reward {rewards.mean():.3f} | loss {out.loss.item():+.4f} | "
              f"entropy {m['mean_entropy']:.3f} | clip {m['clip_frac']:.3f} | "
              f"filtered {m['filtered_frac']:.3f} | conflict {m['conflict_frac']:.3f} | e.g. {prompts[0]}{texts[0]!r}",
              flush=True)


if __name__ == "__main__":
    main()
