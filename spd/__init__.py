"""SPD: Speculative Pipeline Decoding - speculation heads, their training, and a pipelined inference engine.

The public API, imported on first use (``import spd`` stays light: no torch until a name is asked for)::

    from spd import Engine
    engine = Engine.from_pretrained("smollm2/target", speculator="heads/smollm2-135m-instruct-spd-n8")
    out = engine.chat([{"role": "user", "content": "What is a pipeline?"}], max_new_tokens=64)
    print(out.text, out.stats.equivalent_accept_length)  # engine.generate("def fib(n):") for plain text

- :class:`Engine` - the pipelined engine (``pp``, ``spd``, ``tree``; ``ar`` for reference), and
  :class:`SpeculativeDecoder` - serial drafting (``sd``); :func:`load_pipeline` with a :class:`DecodingSpec` resolves
  the cut, loads the target and the head or draft model and builds either, as every program does;
  :func:`build_engine` builds one from loaded parts;
- :class:`BatchedPipeline` - many requests at once through one engine's target;
- :class:`StagedModel` - a Hugging Face causal LM cut into pipeline stages; :func:`generate_ar` - its plain
  autoregressive decoding;
- :class:`Speculator` and :class:`SpeculatorConfig` - the SPD head; :func:`load_speculator` loads a head by name;
- :class:`SamplingParams`, :class:`GenerationOutput` - a request's sampling settings and its result;
- :class:`DistillConfig` - the trainer's settings (``accelerate launch train/distill.py``);
- :class:`SpdInputError` - what every wrong input raises (a ``ValueError``).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "spd.decoding.engine",
    "SpeculativeDecoder": "spd.decoding.sd",
    "build_engine": "spd.decoding.factory",
    "load_pipeline": "spd.decoding.factory",
    "DecodingSpec": "spd.decoding.factory",
    "BatchedPipeline": "spd.decoding.batch",
    "SamplingParams": "spd.decoding.sampling",
    "GenerationOutput": "spd.decoding.generation",
    "generate_ar": "spd.decoding.generation",
    "StagedModel": "spd.target.staging",
    "Speculator": "spd.heads.speculator",
    "SpeculatorConfig": "spd.heads.config",
    "load_speculator": "spd.heads.loading",
    "DistillConfig": "spd.training.distill",
    "SpdInputError": "spd.errors",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'spd' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access skips this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
