"""Lossless-sampling checks: the exact warped target distribution of short continuations, the outcomes an engine
samples over many seeds, and a chi-square goodness-of-fit p-value between the two."""

import torch

from spd.decoding.sampling import SamplingParams, warped_probs


def sequence_probs(staged, prompt, params, length):
    """Exact probability of every continuation of ``length`` tokens under the warped target (AR chain rule)."""
    vocab = staged.vocab_size
    probs = {(): 1.0}
    for _ in range(length):
        nxt = {}
        prefixes = list(probs)
        ids = torch.tensor([prompt + list(p) for p in prefixes])
        with torch.no_grad():
            logits = staged.model(ids).logits[:, -1]
        p_next = warped_probs(logits, params)
        for i, prefix in enumerate(prefixes):
            for tok in range(vocab):
                nxt[prefix + (tok,)] = probs[prefix] * float(p_next[i, tok])
        probs = nxt
    return probs


def chi_square_p_value(counts: dict, probs: dict, samples: int) -> float:
    """Pearson chi-square goodness of fit, cells with expected count < 5 pooled into one."""
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for outcome, p in probs.items():
        expected, observed = p * samples, counts.get(outcome, 0)
        if expected < 5:
            pooled_obs, pooled_exp = pooled_obs + observed, pooled_exp + expected
            continue
        stat += (observed - expected) ** 2 / expected
        dof += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    assert dof >= 10, "too few cells for a meaningful test"
    return float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def sample_outcomes(engine, prompt: list[int], params: SamplingParams, length: int, samples: int):
    """Counts of each ``length``-token continuation over seeds 0..samples-1, and every run's stats."""
    counts, stats = {}, []
    for seed in range(samples):
        out = engine.run(prompt, length, SamplingParams(params.temperature, params.top_k, params.top_p, seed))
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
        stats.append(out.stats)
    return counts, stats
