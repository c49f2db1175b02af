"""Target staging: stage-by-stage execution equals the Hugging Face model's own forward."""

import pytest
import torch

from conftest import tiny_model
from spd.target.cut import split_layers
from spd.target.staging import SpdInputError, StagedModel

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
TOL = 2e-5


def _full_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n_stages", [1, 2, 4, 8])
def test_stage_by_stage_equals_full_forward(family, n_stages):
    model = tiny_model(family)
    ids = torch.randint(3, 128, (1, 23), generator=torch.Generator().manual_seed(1))
    staged = StagedModel(model, n_stages)
    caches = staged.new_caches(capacity=4)  # small on purpose: the caches must grow
    with torch.no_grad():
        hidden = staged.embed(ids)
        for s in range(n_stages):
            hidden = staged.run_stage(s, hidden, caches[s]).hidden_BTD
        logits = staged.logits(hidden)
    torch.testing.assert_close(logits, _full_logits(model, ids), atol=TOL, rtol=0)
    assert [c.length for c in caches] == [23] * n_stages


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_stages_with_kv_equal_full_forward(family):
    """Prefill, then chunks and single tokens, each pushed through the stages in pipeline order."""
    model = tiny_model(family)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    staged = StagedModel(model, 4)
    caches = staged.new_caches(capacity=8)
    pieces = []
    with torch.no_grad():
        for lo, hi in [(0, 7), (7, 8), (8, 12), (12, 13), (13, 20)]:
            pieces.append(staged.logits(staged.forward_stages(ids[:, lo:hi], caches).hidden_BTD))
    torch.testing.assert_close(torch.cat(pieces, 1), _full_logits(model, ids), atol=TOL, rtol=0)


def test_stages_run_independently_at_their_own_positions():
    """Pipeline order: stage 1 runs token t+1 while stage 2 still runs token t; positions are per stage."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    staged = StagedModel(model, 2)
    caches = staged.new_caches()
    with torch.no_grad():
        staged.forward_stages(ids[:, :8], caches)
        h8 = staged.run_stage(0, staged.embed(ids[:, 8:9]), caches[0]).hidden_BTD
        h9 = staged.run_stage(0, staged.embed(ids[:, 9:10]), caches[0]).hidden_BTD
        out8 = staged.run_stage(1, h8, caches[1]).hidden_BTD
        out9 = staged.run_stage(1, h9, caches[1]).hidden_BTD
        got = staged.logits(torch.cat([out8, out9], 1))
    torch.testing.assert_close(got, _full_logits(model, ids[:, :10])[:, 8:10], atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_explicit_positions_match_default_positions(family):
    model = tiny_model(family)
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(4))
    staged = StagedModel(model, 2)
    ref = _full_logits(model, ids)
    caches = staged.new_caches()
    with torch.no_grad():
        staged.forward_stages(ids[:, :6], caches)
        hidden = staged.embed(ids[:, 6:])
        pos = torch.arange(6, 10)[None]
        for s in range(2):
            hidden = staged.run_stage(s, hidden, caches[s], position_ids_BT=pos).hidden_BTD
    torch.testing.assert_close(staged.logits(hidden), ref[:, 6:], atol=TOL, rtol=0)


def test_anchors_are_pre_norm_hidden_states():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(5))
    staged = StagedModel(model, 4)
    with torch.no_grad():
        out = staged.forward_stages(ids, staged.new_caches(), anchors=list(range(9)))
        hf = model(input_ids=ids, output_hidden_states=True).hidden_states
    assert sorted(out.anchors) == list(range(9))
    for layer in range(8):  # HF's last entry is post-norm, so compare H^0..H^7 directly ...
        torch.testing.assert_close(out.anchors[layer], hf[layer], atol=TOL, rtol=0)
    # ... and H^8 through the final norm, which is what HF returns as its last entry.
    torch.testing.assert_close(staged.norm(out.anchors[8]), hf[8], atol=TOL, rtol=0)
    torch.testing.assert_close(out.anchors[8], out.hidden_BTD)


def test_stage_returns_only_its_own_anchors():
    model = tiny_model("llama")
    staged = StagedModel(model, 4)  # boundaries 0, 2, 4, 6, 8
    caches = staged.new_caches()
    with torch.no_grad():
        out = staged.run_stage(0, staged.embed(torch.tensor([[5, 6]])), caches[0], anchors=[0, 1, 2, 4, 8])
    assert sorted(out.anchors) == [0, 1, 2]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_truncate_rolls_back_every_stage(family):
    model = tiny_model(family)
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(3, 128, (1, 16), generator=gen)
    other = torch.randint(3, 128, (1, 5), generator=gen)
    staged = StagedModel(model, 4)
    caches = staged.new_caches()
    with torch.no_grad():
        staged.forward_stages(ids[:, :11], caches)
        staged.forward_stages(other, caches)  # speculated tokens that are then rejected
        staged.truncate(caches, 11)
        assert [c.length for c in caches] == [11] * 4
        got = staged.logits(staged.forward_stages(ids[:, 11:], caches).hidden_BTD)
    torch.testing.assert_close(got, _full_logits(model, ids)[:, 11:], atol=TOL, rtol=0)


def test_sliding_window_layers_are_masked():
    """Mistral with a small window: staged decoding beyond the window matches HF's own windowed forward."""
    model = tiny_model("mistral", sliding_window=6)
    ids = torch.randint(3, 128, (1, 18), generator=torch.Generator().manual_seed(7))
    staged = StagedModel(model, 2)
    caches = staged.new_caches()
    pieces = []
    with torch.no_grad():
        pieces.append(staged.logits(staged.forward_stages(ids[:, :10], caches).hidden_BTD))
        for t in range(10, 18):
            pieces.append(staged.logits(staged.forward_stages(ids[:, t : t + 1], caches).hidden_BTD))
    torch.testing.assert_close(torch.cat(pieces, 1), _full_logits(model, ids), atol=TOL, rtol=0)


def test_eager_attention_is_supported():
    model = tiny_model("llama", attn="eager")
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(8))
    staged = StagedModel(model, 2)
    caches = staged.new_caches()
    with torch.no_grad():
        a = staged.logits(staged.forward_stages(ids[:, :7], caches).hidden_BTD)
        b = staged.logits(staged.forward_stages(ids[:, 7:], caches).hidden_BTD)
    torch.testing.assert_close(torch.cat([a, b], 1), _full_logits(model, ids), atol=TOL, rtol=0)


def test_split_layers():
    assert split_layers(8, 4) == [0, 2, 4, 6, 8]
    assert split_layers(8, 1) == [0, 8]
    assert split_layers(8, boundaries=[3, 5]) == [0, 3, 5, 8]
    assert split_layers(8, boundaries=[0, 3, 8]) == [0, 3, 8]
    assert split_layers(8, 3) == [0, 3, 6, 8]  # the larger stages first where n does not divide the layers
    with pytest.raises(SpdInputError, match="at least 9 layers"):
        split_layers(8, 9)
    with pytest.raises(SpdInputError, match="positive"):
        split_layers(8, 0)
    with pytest.raises(SpdInputError, match="strictly increasing"):
        split_layers(8, boundaries=[4, 4])
    with pytest.raises(SpdInputError, match="strictly increasing"):
        split_layers(8, boundaries=[0, 9])
    with pytest.raises(SpdInputError, match="were requested"):
        split_layers(8, 2, boundaries=[2, 4])


def test_explicit_boundaries_forward():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(9))
    staged = StagedModel(model, boundaries=[1, 2, 7])
    assert staged.n_stages == 4
    with torch.no_grad():
        logits = staged.logits(staged.forward_stages(ids, staged.new_caches()).hidden_BTD)
    torch.testing.assert_close(logits, _full_logits(model, ids), atol=TOL, rtol=0)


def test_unsupported_layer_types_are_refused():
    model = tiny_model("qwen2")
    model.config.layer_types = ["chunked_attention"] * 8
    with pytest.raises(SpdInputError, match="chunked_attention"):
        StagedModel(model, 2)


def test_wrapper_loads_from_a_local_directory(tmp_path):
    model = tiny_model("qwen3")
    model.save_pretrained(tmp_path / "m")
    staged = StagedModel.from_pretrained(tmp_path / "m", n_stages=2)
    ids = torch.tensor([[4, 5, 6, 7]])
    with torch.no_grad():
        got = staged.logits(staged.forward_stages(ids, staged.new_caches()).hidden_BTD)
    torch.testing.assert_close(got, _full_logits(model, ids), atol=TOL, rtol=0)


def test_wrong_paths_are_clear_errors(tmp_path):
    with pytest.raises(SpdInputError, match="does not exist"):
        StagedModel.from_pretrained(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpdInputError, match="could not load"):
        StagedModel.from_pretrained(tmp_path / "empty")
    (tmp_path / "file.bin").write_text("x")
    with pytest.raises(SpdInputError, match="is a file"):
        StagedModel.from_pretrained(tmp_path / "file.bin")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cache_free_hidden_states_match_hf(family):
    model = tiny_model(family)
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(10))
    staged = StagedModel(model, 4)
    with torch.no_grad():
        got = staged.hidden_states(ids, [0, 3, 8])
        hf = model(input_ids=ids, output_hidden_states=True).hidden_states
    assert sorted(got) == [0, 3, 8]
    torch.testing.assert_close(got[3], hf[3], atol=TOL, rtol=0)
    torch.testing.assert_close(staged.logits(got[8]), model(input_ids=ids).logits, atol=TOL, rtol=0)
