"""Half precision: the warning for a dtype this CPU computes only by emulation (spd/target/precision.py), and the
near-tie rule of each dtype (spd/testing/ties.py)."""

import torch

from conftest import tiny_model
from spd.target import precision
from spd.target.loading import load_causal_lm


def test_warns_only_for_an_emulated_dtype_on_the_cpu(monkeypatch):
    monkeypatch.setattr(precision, "cpu_computes_natively", lambda dtype: dtype == torch.float32)
    message = precision.slow_dtype_warning(torch.bfloat16, "cpu", "the target")
    assert message.startswith("warning: this CPU has no native bfloat16 arithmetic")
    assert "the target in bfloat16" in message and "float32" in message and "\n" not in message
    assert precision.slow_dtype_warning(torch.float32, "cpu") is None
    assert "(no AVX512-FP16 or AMX-FP16)" in precision.slow_dtype_warning(torch.float16, "cpu")
    assert precision.slow_dtype_warning(torch.bfloat16, "cuda") is None  # a GPU: no warning, whatever the CPU
    monkeypatch.setattr(precision, "cpu_computes_natively", lambda dtype: True)
    assert precision.slow_dtype_warning(torch.bfloat16, "cpu") is None


def test_float32_is_always_native():
    assert precision.cpu_computes_natively(torch.float32)
    assert isinstance(precision.cpu_computes_natively(torch.bfloat16), bool)


def test_loading_a_model_in_an_emulated_dtype_warns_once(tmp_path, monkeypatch, capsys):
    tiny_model("llama").save_pretrained(tmp_path / "m")
    monkeypatch.setattr(precision, "cpu_computes_natively", lambda dtype: dtype == torch.float32)
    monkeypatch.setattr(precision, "_WARNED", set())
    load_causal_lm(tmp_path / "m", dtype=torch.bfloat16)
    load_causal_lm(tmp_path / "m", dtype=torch.bfloat16)
    load_causal_lm(tmp_path / "m", dtype=torch.float32)
    err = capsys.readouterr().err
    assert err.count("warning: this CPU has no native bfloat16 arithmetic") == 1


def test_a_dtype_named_as_a_string_warns_too(tmp_path, monkeypatch, capsys):
    tiny_model("llama").save_pretrained(tmp_path / "m")
    monkeypatch.setattr(precision, "cpu_computes_natively", lambda dtype: dtype == torch.float32)
    monkeypatch.setattr(precision, "_WARNED", set())
    load_causal_lm(tmp_path / "m", dtype="bfloat16")
    assert capsys.readouterr().err.count("warning: this CPU has no native bfloat16 arithmetic") == 1


def test_a_near_tie_is_eight_spacings_of_the_top_logit_in_its_dtype():
    """Where two runs may part ways: 1e-4 apart in fp32, 8 spacings of the top logit in bf16 (8 significant bits)
    and in fp16 (11), so fp16's tolerance is 8 times tighter than bf16's."""
    from spd.testing.ties import NEAR_TIE, near_tie_tolerance

    assert near_tie_tolerance(12.5, torch.float32) == NEAR_TIE
    assert near_tie_tolerance(12.5, torch.bfloat16) == 8 * 2.0**-4  # 12.5 is in [8, 16): bf16 spacing 2^-4
    assert near_tie_tolerance(-12.5, torch.float16) == 8 * 2.0**-7  # fp16 spacing 2^-7
    for dtype in (torch.bfloat16, torch.float16):  # one spacing is what the dtype tells apart at that logit
        spacing = near_tie_tolerance(12.5, dtype) / 8
        assert torch.tensor(12.5 + spacing, dtype=dtype).item() != 12.5
        assert torch.tensor(12.5 + spacing / 4, dtype=dtype).item() == 12.5
