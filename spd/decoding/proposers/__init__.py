"""The proposers: what grows the token tree by one level per step (the interface: :mod:`.interface`).

- :class:`~.spd_head.SpdHeadProposer`: our SPD heads, any width, one batched query over the bottom nodes;
- :class:`~.head.HeadProposer`: any head through its engine calls (the SPD authors' heads; our output-state and PPSD
  schedules, chains only);
- :class:`~.draft_model.DraftModelProposer`: a small causal LM with the target's tokenizer (no training);
- :class:`~.serial_head.SerialHeadProposer`: our head trained with variant=eagle, the serial drafter of ``--mode sd``.
"""

from .draft_model import Draft, DraftModelProposer, check_same_vocabulary, load_draft_model
from .head import HeadProposer
from .interface import PooledProposer, Proposer, propose_many
from .serial_head import SerialHeadProposer
from .spd_head import SpdHeadProposer, path_rows

__all__ = [
    "Draft",
    "DraftModelProposer",
    "HeadProposer",
    "PooledProposer",
    "Proposer",
    "SerialHeadProposer",
    "SpdHeadProposer",
    "check_same_vocabulary",
    "load_draft_model",
    "path_rows",
    "propose_many",
]
