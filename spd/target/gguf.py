"""A GGUF checkpoint as an ordinary Hugging Face model directory.

transformers reads a GGUF file (``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` package) and
dequantises it to fp32, but refuses to ``save_pretrained`` the result (its config keeps the GGUF
quantisation entry). :func:`materialize_gguf` builds the same architecture from the config without that
entry, loads the dequantised weights into it, and saves model, tokenizer (with its chat template) and
generation config as a plain directory that every part of the toolkit loads like any hub model.

The directory is written under a temporary name beside ``out``, fsynced and renamed into place (an earlier
one swapped out and removed last: :func:`spd.files.replace_dir`), so a killed run leaves no half-written model; ``materialize.json`` inside it records the source file's digest, which makes a
second call a no-op.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from ..errors import SpdInputError
from ..files import replace_dir, temp_dir_beside

MARKER = "materialize.json"


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def is_materialized(out: Path, sha256: str) -> bool:
    """Whether ``out`` holds a complete materialisation of the GGUF file with this digest."""
    marker = out / MARKER
    try:
        return json.loads(marker.read_text()).get("gguf_sha256") == sha256
    except (OSError, ValueError):
        return False


def load_gguf(gguf_path: Path, dtype=None):
    """(model, tokenizer) read from a GGUF file by transformers, dequantised (fp32 by default)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..reading import check_gguf

    check_gguf(gguf_path)  # needs the gguf package, as transformers does; a damaged file is named here
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype or torch.float32)
    return model.eval(), tokenizer


def materialize_gguf(
    gguf_path: str | os.PathLike, out: str | os.PathLike, sha256: str | None = None, source: dict | None = None
) -> Path:
    """Write the model in ``gguf_path`` to ``out`` as a ``save_pretrained`` directory; return ``out``.

    ``source`` (e.g. the package and version the file came from) is recorded in ``out/materialize.json``.
    An existing ``out`` is replaced only when it is an earlier materialisation (it has our marker).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    gguf_path, out = Path(gguf_path), Path(out)
    sha256 = sha256 or file_sha256(gguf_path)
    if is_materialized(out, sha256):
        return out
    if out.exists() and not (out / MARKER).is_file():
        raise SpdInputError(
            f"'{out}' exists and was not written by this tool; choose another output directory or remove it yourself"
        )
    gguf_model, tokenizer = load_gguf(gguf_path)
    config = gguf_model.config
    # The GGUF entry makes save_pretrained refuse the model; the weights are plain fp32 tensors by now.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = gguf_model.state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    # Tied embeddings: the LM head is the embedding, which load_state_dict cannot know from the keys.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SpdInputError(
            f"the GGUF weights do not fit the {config.model_type} architecture "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir_beside(out)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(
            json.dumps({"gguf_file": gguf_path.name, "gguf_sha256": sha256, "source": source or {}}, indent=2) + "\n"
        )
        # An earlier materialisation of another file (checked above) is ours to replace: swapped for the new
        # one, and removed only once the new one is in place.
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
