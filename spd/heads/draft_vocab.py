"""Draft vocabularies: a head whose LM head predicts only the K most frequent target tokens.

Over a 150k-250k vocabulary the head's LM head dominates its cost (EAGLE-3 and SpecForge cut it the same
way). The K tokens are the most frequent *supervised* tokens of the training data (the tokens the head has to
predict), ties broken by the lower token id, stored sorted in the head's weights (``draft_ids``). Training
distils the target restricted to those ids; at inference the head's logits are scattered back to target ids
(:meth:`spd.heads.speculator.Speculator.vocab_logits`), so verification, and therefore the output, is unchanged.
A head's draft vocabulary is checked against the target's vocabulary when it is loaded: ids in range, and
with a tokenizer, the same token strings as when it was trained.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from ..errors import SpdInputError


def token_counts(rows: Iterable[tuple], vocab_size: int) -> torch.Tensor:
    """How often each token id is a supervised target (``loss_mask`` 1) in ``(input_ids, loss_mask)`` rows."""
    counts_V = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in rows:
        ids, mask = torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(mask, dtype=torch.bool)
        counts_V += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts_V


def select_draft_vocab(counts_V: torch.Tensor, k: int) -> torch.Tensor:
    """The K most frequent ids (ties: the lower id first), sorted ascending."""
    if not 1 <= k <= counts_V.numel():
        raise SpdInputError(f"draft_vocab_size must be in 1..{counts_V.numel()} (the target's vocabulary), got {k}")
    order = torch.sort(counts_V, descending=True, stable=True).indices  # stable: equal counts keep id order
    return order[:k].sort().values


def tokens_sha256(tokens: list[str]) -> str:
    """A hash of a draft vocabulary's token strings (``tokenizer.convert_ids_to_tokens(ids)``)."""
    return hashlib.sha256("\n".join(str(t) for t in tokens).encode()).hexdigest()


def check_draft_vocab(head, vocab_size: int, tokenizer=None) -> None:
    """Refuse one of our heads (:class:`spd.heads.speculator.Speculator`) whose draft vocabulary does not fit the
    target's (one clear sentence). The authors' heads carry their own mapping, checked by their loader."""
    ids = head.draft_ids
    if ids is None:
        return
    ids = ids.detach().cpu()
    if ids.numel() != head.config.draft_vocab_size or bool((ids[1:] <= ids[:-1]).any()):
        raise SpdInputError(
            "the speculator's draft vocabulary is corrupt (its ids are not sorted and unique); re-export the head"
        )
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise SpdInputError(
            f"the speculator's draft vocabulary has ids up to {int(ids.max())}, outside the target's "
            f"vocabulary of {vocab_size}"
        )
    expected = head.config.draft_vocab_sha256
    if tokenizer is not None and expected and tokens_sha256(tokenizer.convert_ids_to_tokens(ids.tolist())) != expected:
        raise SpdInputError(
            "the speculator's draft vocabulary does not match this target's tokenizer (its tokens "
            "differ from the ones it was trained on); use the target it was trained for"
        )
