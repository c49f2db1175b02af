"""An SPD authors' head's configuration: their config as stored in the file, read and checked against the target it is
attached to (:class:`AuthorsHeadConfig`, one sentence for a head that does not fit), and the config their tower's
decoder layers are built from. The module that runs the head is :mod:`spd.heads.published.authors_head`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from ...errors import SpdInputError
from ...target.staging import StagedModel
from ..config import equal_cut_problem, misfit
from .authors_file import AuthorsCheckpoint


@dataclass
class AuthorsHeadConfig:
    """What the engine needs to know about an authors' head (the fields our head's config has), plus theirs."""

    version: int
    hidden_size: int
    vocab_size: int
    n_stages: int
    num_layers: int  # L_s
    target_num_layers: int
    boundaries: list[int]
    shallow: list[list[int]] | None  # v10: shallow[b] = anchors of depth n - b
    bound: list[int] | None  # v11: aggr_feature_bound
    draft_token_ids: list[int] | None
    use_deepest: bool
    authors_prefill: bool = True
    raw: dict = field(default_factory=dict)  # their config as stored in the file
    schedule: str = "input"  # the head reads the input state (its speculation runs beside the stages)
    offset: int = 0

    @property
    def max_depth(self) -> int:
        return self.n_stages

    @property
    def lps(self) -> int:
        return self.target_num_layers // self.n_stages

    def aggr_type(self, depth: int) -> int:
        """v11: the aggregation type of a depth: ``max{i : b[i] <= min(L, depth * L/n)}``."""
        assert self.bound is not None, "a v11 head has aggr_feature_bound"
        limit = min(self.target_num_layers, depth * self.lps)
        return max(i for i, b in enumerate(self.bound) if b <= limit)

    def depth_anchors(self, depth: int) -> list[int]:
        """Hidden-state indices a row of this depth concatenates."""
        if self.version == 10:
            assert self.shallow is not None, "a v10 head has shallow_hidden_layer_indices"
            return [0] if depth == 0 else list(self.shallow[self.n_stages - depth])
        assert self.bound is not None, "a v11 head has aggr_feature_bound"
        return list(self.bound[: self.aggr_type(depth) + 1])


def spec_layer_config(staged: StagedModel, num_layers: int, raw: dict, version: int):
    """The config the authors build their tower layers from: the target's text config (Qwen3 parts), or for
    v11 on Qwen3.5 bases a copy of it with the first L_s layers forced to full attention."""
    from transformers import Qwen3Config

    text: Any = staged.config  # a Hugging Face text config (StagedModel declares it an object)
    intermediate = getattr(text, "intermediate_size", None) or raw.get("spec_intermediate_size_fallback", 9216)
    if version == 11 and text.model_type.startswith("qwen3_5"):
        cfg = copy.deepcopy(text)
        types = list(getattr(cfg, "layer_types", None) or [])
        types += ["full_attention"] * max(0, num_layers - len(types))
        types[:num_layers] = ["full_attention"] * num_layers
        cfg.layer_types = types
        cfg.intermediate_size = intermediate
        cfg._attn_implementation = "sdpa"
        return cfg, True
    cfg = Qwen3Config(
        hidden_size=text.hidden_size,
        intermediate_size=intermediate,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        rms_norm_eps=text.rms_norm_eps,
        attention_bias=getattr(text, "attention_bias", False),
        hidden_act=getattr(text, "hidden_act", "silu"),
        num_hidden_layers=num_layers,
        layer_types=["full_attention"] * num_layers,
        vocab_size=text.vocab_size,
    )
    cfg._attn_implementation = "sdpa"
    return cfg, False


def config_for(
    checkpoint: AuthorsCheckpoint, staged: StagedModel, use_deepest: bool | None, authors_prefill: bool
) -> AuthorsHeadConfig:
    """Read their config, check it against the target (``base_model_path`` is ignored), one sentence if not."""
    raw, source = checkpoint.config, checkpoint.source
    text: Any = staged.config  # a Hugging Face text config (StagedModel declares it an object)
    n, big_l = int(raw["num_stages"]), staged.num_layers
    problems = []
    if int(raw["hidden_size"]) != text.hidden_size:
        problems.append(f"hidden size {raw['hidden_size']} vs the target's {text.hidden_size}")
    if int(raw["vocab_size"]) != staged.vocab_size:
        problems.append(f"vocabulary {raw['vocab_size']} vs the target's {staged.vocab_size}")
    cut = equal_cut_problem(n, big_l)
    if cut:
        problems.append(cut)
    if problems:
        raise misfit(problems)
    draft = raw.get("draft_token_ids")
    if draft is not None:
        draft = sorted({int(t) for t in draft})
        if draft and not 0 <= draft[0] <= draft[-1] < staged.vocab_size:
            raise SpdInputError(
                f"the head '{source}' has draft_token_ids outside the target's vocabulary (0..{staged.vocab_size - 1})"
            )
    version = int(raw["version"])
    shallow = bound = None
    if version == 10:
        shallow = [[int(k) for k in a] for a in raw["shallow_hidden_layer_indices"]]
        bad = len(shallow) != n or any(not 0 <= k <= big_l for a in shallow for k in a)
    else:
        bound = [int(k) for k in raw["aggr_feature_bound"]]
        bad = (
            not bound
            or bound[0] != 0
            or any(x >= y for x, y in zip(bound, bound[1:]))
            or bound[-1] > big_l
            or len(bound) > n + 1
        )
    if bad:
        what = "shallow_hidden_layer_indices" if version == 10 else "aggr_feature_bound"
        raise SpdInputError(
            f"the head '{source}' has {what} that do not fit a {big_l}-layer target cut into {n} stages"
        )
    if use_deepest is None or raw.get("trained_with_use_deepest"):
        use_deepest = True  # their evaluation scripts' default, and forced for heads trained with it
    return AuthorsHeadConfig(
        version=version,
        hidden_size=int(raw["hidden_size"]),
        vocab_size=int(raw["vocab_size"]),
        n_stages=n,
        num_layers=int(raw["num_spec_layers"]),
        target_num_layers=big_l,
        boundaries=[big_l // n * s for s in range(n + 1)],
        shallow=shallow,
        bound=bound,
        draft_token_ids=draft,
        use_deepest=bool(use_deepest),
        authors_prefill=authors_prefill,
        raw=dict(raw),
    )
