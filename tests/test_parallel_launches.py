"""Vocabulary-parallel logits stay on the path (spec 8, 12): a gtpo_loss(process_group=...) forward +
backward on 2 gloo ranks, counted as a GPU would launch it (bench.launches_parallel.counts: Triton
launches plus aten ops that launch a kernel, collectives included), at two token counts: the merge of
the slices' statistics is one kernel between its two all-reduces (the forward kernel stores the first
all-reduce's input, the epilogue kernel finishes the second's sums), the agreement's checksums one
kernel for the whole row it all-gathers (no per-field launch), one host read unvalidated
(the agreement's), no tensor made from host data (a host-to-device copy on a GPU: the row's host values are
written by its kernel, their checksum a launch argument), and nothing grows with the tokens;
linear_token_logprobs (one tile of the LM head) too."""
import os

from gloo import run_ranks_ok

SIZES = ((4, 5), (8, 6))
# today's counts, rank 0 of 2 (python -m bench.launches_parallel), as bounds: they were 185 / 222 / 204,
# with 2 / 2 / 4 host reads, before the merge, the checksums and the host checks' predicates ran as kernels
# validating, the host checks' values ride on the agreement's read (agree.deferred: the row's kernel forms their
# predicates into its error flag) and the epilogue's status word is read once: 3 -> 2 reads
# (gtpo validating: the entropy filter drops every completion of this batch, so the status word warns; its
# value as read serves the warning, no read more)
# (17 / 20 / 23 / 26 before the Triton passes read the caller's mask as given and a number tau by value, and
# the agreement's checksums were formed by one kernel a field where they are now one kernel a row, and the
# forward kernel stores the slice's maximum, the merge's first input, itself, and the kernels subtract the
# slice's first id as they read an id; one more before the epilogue ran in the custom op that attaches the
# backward, whose value was a copy of the epilogue's; one more before the epilogue finished the merge itself)
# (16 / 17 validating before the agreement row's kernel formed the value checks' predicates: one launch a
# check, the torch.ones of an unmasked batch's counted tokens, and the stack, any and masked_fill_ that put
# their flags into the row)
# (packed: 30 / 33 before the agreement's checksums read cu_seqlens, the ids and the advantages as given, and
# its row's kernel checked cu_seqlens and max_seqlen: the stand-in cu_seqlens, segments, malformed flag and
# the ids and advantages made for it were formed for the checksums alone, and the checks launched their own)
# (a temperature per token: 25 unvalidated before the epilogue's path read it as given, where its values were
# checked by a dozen launches and made NaN where invalid; its kernels NaN such a token themselves. Validating:
# 28 before the agreement row's kernel checked it, RowCheck 'positive'; 10 before it read the mask as given,
# where the counted tokens were made for it)
# (a temperature per completion: 10 unvalidated before the kernels read it at each token's row (padded), where
# it was spread on the tokens; validating it is still spread, for its check: 10)
# (a temperature per completion, packed: 33 unvalidated before its values went to the kernels as given (spread to
# the tokens, 4 launches), where a dozen launches made its invalid values NaN and b.seg spread it; validating 19
# before its spread read the given cu_seqlens, where the batch's stand-in was made for it: 14.
# Rollout weights per completion, packed: 19 / 20 before their spread for the agreement's checksum read the given
# cu_seqlens (searchsorted, 4 launches), where the batch's stand-in cu_seqlens and segments were made for it: 13 / 14)
# (per completion, packed, a temperature or rollout weights: 13 / 14 before the agreement row's kernel and the
# merge's sums kernel found each token's completion in the given cu_seqlens (vocab_status._seqs_of), where they
# were spread on the tokens; validating, a temperature per completion 10 (padded) and 14 (packed) before the
# agreement row checked it at each token's completion, where its spread was made for the check; the validated
# packed row's eight terms took two launches of six before a launch took eight)
# (rollout weights per completion: 12 / 23 before the agreement's checksum and check read them at each token's
# row, where their spread on the tokens was made for the checksum, and for the check with a dozen launches)
# (linear_token_logprobs, one tile: 26 before the kernels wrote NaN at a flagged token and kept the masked-out
# tokens' zeros; validating 19 and 6 host reads before its value checks rode on the agreement's read; 4 / 5 reads
# before its plan listed the counted rows in a size the host knows (nonzero_static after the one read of the rows
# per completion, where nonzero and bincount read the device each), counted 18 / 19 launches then, when the counter
# did not count those two as launches; validated, the flags' read is one launch, counted since)
# (token_logprobs: 16 before the merge's finish kernel wrote its outputs as returned, NaN at a flagged token,
# and a number tau went by value, where a CPU tensor of it was copied to the device)
# (the loss: 9 / 10 (grpo / gtpo) before this slice's forward pass and the agreement row's program ran in one
# launch before the agreement, vp_first_triton, where the row's kernel and the forward kernel were two around it)
# (gtpo: 9 before the conflict weights computed in the call ran as programs of the merge's sums launch, where
# they took a launch of their own)
BOUND = {("grpo", False): 8, ("gtpo", False): 8, ("grpo", True): 8, ("gtpo", True): 8,
         ("grpo-packed", False): 8, ("grpo-packed", True): 8, ("token_logprobs", False): 7, ("token_logprobs", True): 8,
         ("grpo-tau-token", False): 8, ("grpo-tau-token", True): 8, ("grpo-rollout-seq", False): 8,
         ("grpo-rollout-seq", True): 8, ("linear_token_logprobs", False): 20, ("linear_token_logprobs", True): 21, ("grpo-tau-seq", False): 8,
         ("grpo-tau-seq", True): 8, ("grpo-tau-seq-packed", False): 8, ("grpo-tau-seq-packed", True): 8,
         ("grpo-rollout-seq-packed", False): 8, ("grpo-rollout-seq-packed", True): 8,
         # the sets rebuilt by top_k on a split vocabulary: eager code, not yet on the path (docs/parallelism.md);
         # bounded so that it does not grow, and it makes no tensor from host data (1 before kept_set's fill_);
         # 408 / 413 before the loss math on the merged log-probs ran in the epilogue kernel (the eager surrogate);
         # 290 / 295 before the merge read the sampled id's logit at its set entry (one gather, not two)
         ("grpo-top-k", False): 286, ("grpo-top-k", True): 291}
READS = {("grpo", False): 1, ("gtpo", False): 1, ("grpo", True): 2, ("gtpo", True): 2,  # validating: the status word
         ("grpo-packed", False): 1, ("grpo-packed", True): 2, ("token_logprobs", False): 1,
         ("token_logprobs", True): 2, ("grpo-tau-token", False): 1, ("grpo-tau-token", True): 2,
         ("grpo-rollout-seq", False): 1, ("grpo-rollout-seq", True): 2,
         ("linear_token_logprobs", False): 2, ("linear_token_logprobs", True): 3,  # (the head: its plan's one more)
         ("grpo-tau-seq", False): 1, ("grpo-tau-seq", True): 2, ("grpo-tau-seq-packed", False): 1,
         ("grpo-tau-seq-packed", True): 2, ("grpo-rollout-seq-packed", False): 1, ("grpo-rollout-seq-packed", True): 2,
         ("grpo-top-k", False): 10, ("grpo-top-k", True): 13}
# (token_logprobs validating: its flags)


# counted at both sizes (flat in tokens); the others at the first size (CI time: every one at both, nightly)
FLAT = ("grpo", "gtpo", "grpo-packed", "token_logprobs", "grpo-tau-token")
MORE = ("grpo-rollout-seq", "linear_token_logprobs", "grpo-tau-seq", "grpo-tau-seq-packed", "grpo-rollout-seq-packed",
        "grpo-top-k")


def _ranks(rank, world):
    from bench.launches_parallel import counts
    out = {}
    nightly = os.environ.get("HYPOTHESIS_PROFILE", "ci") == "nightly"
    for i, (B, T) in enumerate(SIZES):  # (the second size without a first call: its counts equal the first's)
        cfgs = FLAT + MORE if i == 0 or nightly else FLAT
        rows = counts(rank, world, B, T, configs=cfgs, validates=(False,), warm=i == 0)
        rows += counts(rank, world, B, T, configs=cfgs, validates=(True,), warm=i == 0)
        out[f"{B}x{T}"] = rows
    return out


def test_vocabulary_parallel_launches_are_few_and_flat_in_tokens():
    results = run_ranks_ok(_ranks, 2)
    for res in results:
        by_size = [{(c, v): (n, tr, reads, made) for c, v, n, tr, reads, made in rows} for rows in res.values()]
        assert {k: v for k, v in by_size[0].items() if k in by_size[1]} == by_size[1], by_size  # flat in tokens
        assert {c for c, _ in by_size[1]} >= set(FLAT), by_size
        for key, (n, triton, reads, made) in by_size[0].items():
            assert n <= BOUND[key], (key, n)
            assert made == 0, (key, made)  # (1 before the row's kernel wrote its host values: torch.tensor(...).to)
            # the merge's and the checksums' kernels ran (not torch ops; the loss: the checksums in the forward's
            # launch); token_logprobs: no epilogue, no backward (the eager top_k path: the agreement's alone)
            assert triton >= (1 if key[0] == "grpo-top-k" else 4), (key, triton)
            assert reads <= READS[key], (key, reads)
