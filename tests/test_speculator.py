"""The speculation module: efficient layout == dense reference, incremental == training forward, round trips."""

import pytest
import torch

from spd.heads.config import SpeculatorConfig, default_anchors
from spd.heads.kernels import offset_band_attention
from spd.heads.speculator import Speculator

L, D = 8, 32


def _head(n, num_layers, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = SpeculatorConfig(
        hidden_size=D,
        vocab_size=40,
        n_stages=n,
        target_num_layers=L,
        num_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        **kw,
    )
    return Speculator(cfg).double()


def _inputs(batch, n_pos, n, seed=1, pad=True):
    gen = torch.Generator().manual_seed(seed)
    hidden = {layer: torch.randn(batch, n_pos, D, generator=gen, dtype=torch.float64) for layer in range(L + 1)}
    fill = torch.randint(1, n + 1, (batch,), generator=gen)
    valid = torch.ones(batch, n_pos, dtype=torch.bool)
    if pad:
        valid[0, n_pos - 4 :] = False  # right padding, as the data collator produces
    return hidden, fill, valid


VARIANTS = [dict(), dict(schedule="output"), dict(schedule="output", max_depth=1), dict(memory_proj=True, qk_norm=True)]


def _assert_equals_dense(head, hidden, fill, valid, **kw):
    """forward_train (with ``kw``) equals forward_dense on valid rows, and so do all gradients."""
    for h in hidden.values():
        h.requires_grad_(True)
    weights_D = torch.linspace(-1, 1, D, dtype=torch.float64)
    eff = head.forward_train(hidden, fill, valid, **kw)
    (eff[valid] * weights_D).sum().backward()
    grads_eff = [
        None if t.grad is None else t.grad.clone() for t in [*head.parameters(), *(hidden[a] for a in sorted(hidden))]
    ]
    head.zero_grad()
    for h in hidden.values():
        h.grad = None
    dense = head.forward_dense(hidden, fill, valid)
    (dense[valid] * weights_D).sum().backward()
    grads_dense = [t.grad for t in [*head.parameters(), *(hidden[a] for a in sorted(hidden))]]
    torch.testing.assert_close(eff[valid], dense[valid], atol=1e-12, rtol=0)
    assert sum(g is not None for g in grads_eff) > 10
    for ge, gd in zip(grads_eff, grads_dense):
        if ge is None or gd is None:  # unused depths' FCs, the norm and head: no gradient in either path
            assert ge is None or not ge.any()
            assert gd is None or not gd.any()
        else:
            torch.testing.assert_close(ge, gd, atol=1e-10, rtol=0)
    return eff


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
@pytest.mark.parametrize("query_chunk", [512, 4])
def test_efficient_layout_equals_dense_reference(n, num_layers, variant, query_chunk):
    """Outputs and gradients (weights and anchor states), random fills per example, right padding, GQA;
    one query block, or blocks of 4 rows (band keys from the previous block, deep keys skipped per block)."""
    head = _head(n, num_layers, **VARIANTS[variant])
    hidden, fill, valid = _inputs(3, 17, n)
    _assert_equals_dense(head, hidden, fill, valid, query_chunk=query_chunk)


@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_every_fill_in_one_batch_equals_dense(variant):
    """Fills 1 .. n side by side (the per-example offsets and band widths differ inside one block)."""
    n = 8
    head = _head(n, 1, **VARIANTS[variant])
    hidden, _, valid = _inputs(n, 21, n, pad=False)
    valid[2, 15:] = False
    valid[5, 9:] = False
    fill = torch.tensor([1, 8, 3, 5, 2, 8, 7, 4])
    _assert_equals_dense(head, hidden, fill, valid, query_chunk=6)


def test_rows_without_any_key_are_zero_and_finite():
    """Left padding: a query row whose own row is padding and has no earlier real row attends nothing;
    its attention output is 0 (not NaN) and every gradient stays finite."""
    head = _head(4, 2)
    hidden, _, valid = _inputs(2, 12, 4, pad=False)
    valid[1, :5] = False
    fill = torch.tensor([4, 2])
    _assert_equals_dense(head, hidden, fill, valid, query_chunk=3)
    for h in hidden.values():
        h.grad = None
    out = head.forward_train(hidden, fill, valid, query_chunk=3)
    assert torch.isfinite(out).all()
    out.pow(2).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in [*head.parameters(), *hidden.values()] if t.grad is not None)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 12, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    kv = {
        d: tuple(torch.randn(2, 2, 12, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in "kv")
        for d in range(5)
    }
    attn = offset_band_attention(q, kv, 4, [0, 1, 2, 3], fill, valid, query_chunk=3)
    assert attn[1, :, :5].eq(0).all() and attn[1, :, 5:].ne(0).all() and attn[0].ne(0).all()
    attn.sum().backward()
    assert torch.isfinite(q.grad).all() and all(torch.isfinite(t.grad).all() for pair in kv.values() for t in pair)


def test_features_equal_the_linear_layer_on_the_concatenation():
    """features() sums one product per anchor; it is FC_d on the concatenated anchors, gradients included
    (the default anchors of depth 1 repeat H^0)."""
    head = _head(8, 1)
    hidden, _, _ = _inputs(2, 5, 8, pad=False)
    for h in hidden.values():
        h.requires_grad_(True)
    for depth in (0, 1, 5):
        anchors = head.config.anchors[depth]
        fc = head.fc[str(depth)]
        weights_BND = torch.randn(2, 5, D, dtype=torch.float64)
        grads = []
        for out in (head.features(depth, hidden), fc(torch.cat([hidden[a] for a in anchors], dim=-1))):
            (out * weights_BND).sum().backward()
            grads.append([fc.weight.grad.clone(), *(hidden[a].grad.clone() for a in sorted(set(anchors)))])
            head.zero_grad()
            for h in hidden.values():
                h.grad = None
            grads[-1].append(out.detach())
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_training_forward_under_autocast():
    """bf16 autocast (as accelerate's mixed precision): the blockwise attention and the per-anchor
    features run in bf16 and stay close to the float32 forward; backward gives float32 gradients."""
    head = _head(4, 2).float()
    hidden, fill, valid = _inputs(2, 19, 4)
    hidden = {k: v.float() for k, v in hidden.items()}
    ref = head.forward_train(hidden, fill, valid, query_chunk=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = head.forward_train(hidden, fill, valid, query_chunk=8)
    out.float().pow(2).sum().backward()
    assert all(
        p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in head.parameters() if p.grad is not None
    )
    torch.testing.assert_close(out.float()[valid], ref[valid], atol=0.05, rtol=0.05)


def test_efficient_layout_equals_dense_in_float32():
    head = _head(4, 2).float()
    hidden, fill, valid = _inputs(2, 33, 4)
    hidden = {k: v.float() for k, v in hidden.items()}
    for chunk in (512, 7):
        torch.testing.assert_close(
            head.forward_train(hidden, fill, valid, query_chunk=chunk)[valid],
            head.forward_dense(hidden, fill, valid)[valid],
            atol=2e-5,
            rtol=0,
        )


def test_fill_changes_the_output():
    """The layouts differ per fill (a test that would pass for any mask is no test)."""
    head = _head(4, 1)
    hidden, _, valid = _inputs(1, 12, 4, pad=False)
    outs = [head.forward_train(hidden, torch.tensor([a]), valid) for a in (1, 2, 4)]
    assert not torch.allclose(outs[0][:, 3:], outs[1][:, 3:])
    assert not torch.allclose(outs[1][:, 3:], outs[2][:, 3:])
    # ... except at t = 0, where every fill sees only the query's own row.
    torch.testing.assert_close(outs[0][:, 0], outs[2][:, 0])


@pytest.mark.parametrize("n,num_layers", [(2, 1), (4, 2), (8, 1)])
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_incremental_forward_equals_training_forward(n, num_layers, variant):
    _check_incremental(_head(n, num_layers, **VARIANTS[variant]), n)


def _check_incremental(head, max_fill):
    """Inference (cached depth-max rows + trailing rows at their depths) equals the training forward at every t."""
    cfg = head.config
    hidden, fill, _ = _inputs(1, 15, max_fill, pad=False)
    train = head.forward_train(hidden, fill)
    a = int(fill[0])
    for t in range(15):
        cache = head.new_cache(capacity=2)  # grows on demand
        committed = max(0, t - a + 1)
        # Append deep rows in two pieces, as the engine does step by step.
        for lo, hi in [(0, committed // 2), (committed // 2, committed)]:
            if hi > lo:
                head.append_memory(cache, head.features(cfg.max_depth, {k: v[:, lo:hi] for k, v in hidden.items()}))
        trailing = [
            (cfg.depth(t - i, a), head.features(cfg.depth(t - i, a), {k: v[:, i] for k, v in hidden.items()}))
            for i in range(committed, t + 1)
        ]
        query = head.features(cfg.offset, {k: v[:, t] for k, v in hidden.items()})
        torch.testing.assert_close(head.query(cache, trailing, query), train[:, t], atol=1e-12, rtol=0)


SERIAL = dict(schedule="serial", max_depth=1, memory_proj=True)


def test_serial_schedule_depths():
    """variant eagle: the whole target is one stage; the a newest rows are at depth 0, the rest at depth 1."""
    cfg = SpeculatorConfig(hidden_size=D, n_stages=1, target_num_layers=8, schedule="serial", max_depth=1)
    assert cfg.draft_steps == 8 and cfg.max_fill == 8 and cfg.used_depths == [0, 1]
    assert cfg.anchors == [[0], [0, 4, 8]]  # low / mid / high features of the whole target, as EAGLE-3
    assert [cfg.depth(d, 3) for d in range(5)] == [0, 0, 0, 1, 1]
    assert SpeculatorConfig(hidden_size=D, n_stages=4, target_num_layers=8).draft_steps is None
    with pytest.raises(ValueError, match="serial schedule reads the whole target"):
        SpeculatorConfig(hidden_size=D, n_stages=4, target_num_layers=8, schedule="serial", max_depth=1)


@pytest.mark.parametrize("draft_steps", [1, 3, 8])
@pytest.mark.parametrize("query_chunk", [512, 4])
def test_serial_schedule_efficient_layout_equals_dense(draft_steps, query_chunk):
    """The band of the serial schedule (every band key at depth 0) in the blockwise path equals the dense mask."""
    head = _head(1, 2, draft_steps=draft_steps, **SERIAL)
    hidden, fill, valid = _inputs(3, 17, draft_steps)
    _assert_equals_dense(head, hidden, fill, valid, query_chunk=query_chunk)


@pytest.mark.parametrize("draft_steps", [1, 4])
def test_serial_schedule_incremental_forward_equals_training_forward(draft_steps):
    _check_incremental(_head(1, 2, draft_steps=draft_steps, **SERIAL), draft_steps)


def test_cache_truncation_is_rollback():
    head = _head(4, 2)
    hidden, _, _ = _inputs(1, 10, 4, pad=False)
    rows = head.features(4, hidden)
    fresh = head.new_cache()
    head.append_memory(fresh, rows[:, :6])
    rolled = head.new_cache()
    head.append_memory(rolled, rows[:, :8])
    rolled.truncate(6)
    q = head.features(0, {k: v[:, 9] for k, v in hidden.items()})
    trailing = [(0, q)]
    torch.testing.assert_close(head.query(rolled, trailing, q), head.query(fresh, trailing, q))


def test_save_and_load_round_trip(tmp_path):
    head = _head(4, 2, memory_proj=True, schedule="output", target_name_or_path="some/target")
    head.save_pretrained(tmp_path / "head")
    assert (tmp_path / "head" / "model.safetensors").is_file()
    loaded = Speculator.from_pretrained(tmp_path / "head", dtype=torch.float64)
    strip = lambda d: {k: v for k, v in d.items() if k != "_name_or_path"}  # noqa: E731
    assert strip(loaded.config.to_dict()) == strip(head.config.to_dict())
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    hidden, fill, valid = _inputs(2, 9, 4)
    torch.testing.assert_close(loaded.forward_train(hidden, fill, valid), head.forward_train(hidden, fill, valid))


def test_default_anchors_follow_the_spec():
    assert default_anchors([0, 2, 4, 6, 8]) == [[0], [0, 1, 2], [0, 2, 4], [0, 3, 6], [0, 4, 8]]
    cfg = SpeculatorConfig(hidden_size=D, n_stages=4, target_num_layers=8)
    assert cfg.used_depths == [0, 1, 2, 3, 4]
    ppsd = SpeculatorConfig(hidden_size=D, n_stages=4, target_num_layers=8, schedule="output", max_depth=1)
    assert ppsd.used_depths == [1]
    assert Speculator(ppsd).needed_anchors() == [0, 1, 2]  # first stage only: H^0, H^1, H^2 of 8 layers / 4


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(n_stages=3), "divide"),
        (dict(anchors=[[0], [0, 5]]), "anchors must list"),
        (dict(n_stages=2, anchors=[[0], [0, 5], [0, 8]]), r"anchors\[1\]"),
        (dict(schedule="sideways"), "schedule"),
        (dict(max_depth=9), "max_depth"),
        (dict(boundaries=[0, 4, 4, 6, 8]), "boundaries"),
    ],
)
def test_bad_configs_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpeculatorConfig(**{"hidden_size": D, "n_stages": 4, "target_num_layers": 8, **kwargs})


@pytest.mark.parametrize("n", [2, 8])
def test_query_blocks_equal_one_block(n):
    """Blockwise attention is the same computation for any block size: same outputs and gradients."""
    head = _head(n, 2, memory_proj=True)
    hidden, fill, valid = _inputs(2, 23, n)
    for h in hidden.values():
        h.requires_grad_(True)
    grads = []
    outs = []
    for chunk in (512, 5):
        out = head.forward_train(hidden, fill, valid, query_chunk=chunk)
        out[valid].pow(2).sum().backward()
        outs.append(out)
        grads.append([t.grad.clone() for t in [*head.parameters(), *hidden.values()] if t.grad is not None])
        head.zero_grad()
        for h in hidden.values():
            h.grad = None
    torch.testing.assert_close(outs[0], outs[1], atol=1e-12, rtol=0)
    assert len(grads[0]) == len(grads[1]) > 10
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize("variant", [0, 3])
def test_a_pool_s_joint_query_equals_each_request_alone(variant):
    """The memory of a batched pipeline's requests in one pool (a slot each, the buffers growing while rows are
    held, a slot given back and taken again): rows appended for many requests at once land where each request's own
    cache would hold them, and the joint query, read in place over the pool, equals each query row asked alone over
    a plain cache: chains and several query rows per request (a tree's bottom nodes), 0 to 4 trailing rows."""
    head = _head(4, 2, **VARIANTS[variant])
    cfg = head.config
    gen = torch.Generator().manual_seed(3)

    def rows(depth, count):
        return head.features(
            depth, {a: torch.randn(count, D, generator=gen, dtype=torch.float64) for a in range(L + 1)}
        )

    pool = head.new_pool(slots=5, capacity=4)
    caches = [pool.cache(capacity=2) for _ in range(4)]
    pool.release(caches[1])
    caches[1] = pool.cache(capacity=3)  # the freed slot again: the lowest free one
    assert [c.slot for c in caches] == [0, 1, 2, 3] and pool.free == [4]
    plain = [head.new_cache(capacity=2) for _ in caches]
    for sizes in ([3, 5, 1, 2], [0, 4, 0, 4]):  # two rounds of appends, the pool grows in the second
        picked = [i for i, size in enumerate(sizes) if size]
        mems = [rows(cfg.max_depth, sizes[i]) for i in picked]
        head.append_memory_many([caches[i] for i in picked], mems)
        for i, mem in zip(picked, mems):
            head.append_memory(plain[i], mem[None])
    assert pool.capacity >= 9 and [c.length for c in caches] == [3, 9, 1, 6]
    for pooled, alone in zip(caches, plain):
        for held, own in ((pooled.keys, alone.keys), (pooled.values, alone.values)):
            for i in range(cfg.num_layers):
                torch.testing.assert_close(
                    held[i][:, :, : alone.length], own[i][:, :, : alone.length], atol=1e-12, rtol=0
                )
    asked = [0, 1, 3]  # slot 2 asks nothing this time
    shapes = {0: (1, [4, 3]), 1: (3, [4, 3, 2, 1]), 3: (2, [])}  # query rows, the trailing rows' depths
    trailing = {i: [(d, rows(d, shapes[i][0])) for d in shapes[i][1]] for i in asked}
    queries = {i: rows(cfg.offset, shapes[i][0]) for i in asked}
    joint = head.query_many([caches[i] for i in asked], [trailing[i] for i in asked], [queries[i] for i in asked])
    alone = torch.cat(
        [
            head.query(plain[i], [(d, g[row : row + 1]) for d, g in trailing[i]], queries[i][row : row + 1])
            for i in asked
            for row in range(shapes[i][0])
        ]
    )
    torch.testing.assert_close(joint, alone, atol=1e-12, rtol=0)
    assert [c.length for c in caches] == [3, 9, 1, 6]  # the trailing rows went to scratch rows only
    pool.release(caches[3])
    with pytest.raises(RuntimeError, match="not held"):
        pool.release(caches[3])
