"""Stand-ins for proposers, drafts and engines: a chain engine and a tree source whose proposals are scripted right
or wrong, a draft that is the target with a noisy LM head, and a tree engine with a rule that is not lossless
(a negative control)."""

import copy

import torch

from spd.decoding.engine import Engine


class ScriptedEngine(Engine):
    """The real engine and head, but each proposal's token is replaced by a scripted right or wrong one (greedy).

    ``right(position) -> bool`` decides; the right token is the autoregressive reference's, a wrong one
    differs from it. Used to force the flush paths that a head would hit only by chance.
    """

    def __init__(self, engine, reference, prompt_len, right):
        super().__init__(engine.staged, engine.proposer)
        self.proposer = ScriptedProposer(self.proposer, reference, prompt_len, right, engine.staged.vocab_size)


class ScriptedProposer:
    """A real proposer whose one candidate per step is forced to the scripted token (all other log-probs -inf)."""

    batches = False  # asked alone (a wrapper has no expand_many)

    def __init__(self, inner, reference, prompt_len, right, vocab_size):
        self.inner, self.reference, self.prompt_len, self.right = inner, reference, prompt_len, right
        self.vocab_size = vocab_size

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __copy__(self):  # a request's own copy (the batched pipeline's): its own inner proposer state too
        return ScriptedProposer(copy.copy(self.inner), self.reference, self.prompt_len, self.right, self.vocab_size)

    def expand(self, tree, context, levels):
        logprobs_LX = self.inner.expand(tree, context, levels)
        position = len(context) + tree.depth + 1  # of the proposal
        index = position - self.prompt_len
        good = self.reference[index] if index < len(self.reference) else 0
        token = good if self.right(position) else (good + 1) % self.vocab_size
        forced_LX = torch.full_like(logprobs_LX, float("-inf"))
        forced_LX[:, token] = 0.0
        return forced_LX


def noisy_copy(model, noise: float, seed: int = 1):
    """The target itself with noise on its LM head: a draft that agrees with the target only partly."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = draft.lm_head.weight
        w.add_(noise * w.std() * torch.randn(w.shape, generator=gen))
    return draft


class ScriptedSource:
    """A real source whose log-probabilities on the reference path are forced right (the reference token ranked
    ``rank``-th after the node, the ``rank`` tokens before it at log-prob 0 and it just below, so the path is always
    kept) or wrong (the reference token removed), by ``right(position)``."""

    batches = False  # asked alone (a wrapper has no expand_many)

    def __init__(self, inner, sequence, right, rank=0):
        self.inner, self.sequence, self.right, self.rank = inner, sequence, right, rank

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def expand(self, tree, context, levels):
        logprobs_LX = self.inner.expand(tree, context, levels).clone()
        committed = len(context)
        for row, node in enumerate(tree.bottom_level().tolist()):
            path = tree.path(node).tolist()
            position = committed + len(path)  # of the node's children
            if self.sequence[committed:position] != path or position >= len(self.sequence):
                continue
            good = self.sequence[position]
            logprobs_LX[row, good] = float("-inf")
            if self.right(position):
                if self.rank:
                    logprobs_LX[row, torch.topk(logprobs_LX[row], self.rank).indices] = 0.0
                logprobs_LX[row, good] = -1e-6 if self.rank else 0.0
        return logprobs_LX


class IndependentBranches(Engine):
    """Negative control: every child checked on its own with min(1, p/q), the first accepted one wins (the
    reference code's rule at T > 0, docs/method.md §6) - not lossless."""

    @staticmethod
    def _verify_sampled(p_V, tokens_C, q_V, generator):
        for i, x in enumerate(tokens_C.tolist()):
            if float(torch.rand((), generator=generator, dtype=torch.float64)) * float(q_V[x]) < float(p_V[x]):
                return i, x
        return None, int(torch.multinomial(p_V, 1, generator=generator))
