"""Before the first request, every rank shows the others what it runs: a job whose machines run another spd or
torch version, another target (config or weights), another pipeline cut, dtype or runtime setting is refused at
once on every rank with one line naming the difference, instead of decoding garbage or waiting for a message
that never comes.

The identities travel as JSON bytes in tensors over the control group (never pickled: a peer's bytes are
parsed, not executed)."""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from ..errors import SpdInputError

# What each identity field is called in the refusal, in the order they are checked.
FIELDS = {
    "spd": "spd version",
    "torch": "torch version",
    "target": "target (config and weights)",
    "cut": "pipeline cut",
    "dtype": "dtype",
    "runtime": "runtime settings",
}
MAX_IDENTITY_BYTES = 1 << 16


def target_fingerprint(config, checkpoint) -> str:
    """A short hash of the target's config (without its local path) and of its checkpoint (a
    :class:`~spd.runtime.loading.Checkpoint`). One file, which every machine holds: every tensor's name, dtype
    and shape and the bytes of its first row, read through safetensors' memory map (a few KB per tensor), so two
    machines holding differently trained weights of one architecture disagree too. Shards, of which a machine
    holds only its own: the index (every tensor's name and shard file, and the total size)."""
    from safetensors import safe_open

    digest = hashlib.sha256()
    settings = {
        k: v
        for k, v in config.to_dict().items()
        if k not in ("_name_or_path", "transformers_version", "dtype", "torch_dtype")
    }
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    if checkpoint.sharded:
        index = json.loads(checkpoint.index_text)
        digest.update(
            json.dumps(
                {"weight_map": index.get("weight_map"), "total_size": index.get("metadata", {}).get("total_size")},
                sort_keys=True,
            ).encode()
        )
        return digest.hexdigest()[:12]
    handles = {}
    for name in sorted(checkpoint.weight_map):
        path = checkpoint.path(name)
        if path not in handles:
            handles[path] = safe_open(path, framework="pt", device="cpu")
        part = handles[path].get_slice(name)
        shape = part.get_shape()
        first = part[0:1] if shape else handles[path].get_tensor(name)
        digest.update(f"{name}|{part.get_dtype()}|{shape}|".encode())
        digest.update(first.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:12]


def job_identity(source: str, revision: str | None, staged, dtype: torch.dtype, config) -> dict:
    """What must be the same on every rank of one job: this rank's ``staged`` part of the target ``source`` and
    its RuntimeConfig ``config``."""
    import spd

    from .loading import Checkpoint

    fingerprint = target_fingerprint(staged.model.config, Checkpoint(source, revision))
    return {
        "spd": spd.__version__,
        "torch": torch.__version__,
        "target": fingerprint,
        "source": source,
        "cut": list(staged.boundaries),
        "dtype": str(dtype).removeprefix("torch."),
        "runtime": runtime_settings(config),
    }


def runtime_settings(config) -> dict:
    """The settings of a RuntimeConfig that every rank must share, as values: a time given as the int 10 on one
    rank and the float 10.0 on another is the same setting."""
    return {
        "backend": config.backend,
        "early_launch": bool(config.early_launch),
        "emulate_stage_ms": float(config.emulate_stage_ms),
        "emulate_token_ms": float(config.emulate_token_ms),
        "emulate_link_ms": float(config.emulate_link_ms),
    }


def mismatch(identities: list[dict]) -> str | None:
    """The first field on which the ranks disagree, as one sentence; None when they all agree."""
    for field, what in FIELDS.items():
        groups: dict[str, list[int]] = {}
        for rank, identity in enumerate(identities):
            groups.setdefault(json.dumps(identity.get(field), sort_keys=True), []).append(rank)
        if len(groups) == 1:
            continue
        parts = []
        for value, ranks in groups.items():
            shown = json.loads(value)
            if field == "target":
                shown = f"'{identities[ranks[0]].get('source')}' ({shown})"
            elif field == "runtime":
                shown = ", ".join(f"{k} {v}" for k, v in shown.items())
            label = "rank" if len(ranks) == 1 else "ranks"
            parts.append(f"{label} {', '.join(map(str, ranks))} {'has' if len(ranks) == 1 else 'have'} {shown}")
        return (
            f"the ranks of this job disagree on the {what}: {'; '.join(parts)}; every machine must run the same "
            f"spd and torch versions, target, pipeline cut, dtype and runtime settings"
        )
    return None


def check_same_job(identity: dict, group) -> None:
    """Exchange identities with every rank of ``group`` (collective: every rank calls it once, after joining)
    and raise :class:`SpdInputError` on all of them when they differ."""
    data = json.dumps(identity, sort_keys=True).encode()
    # (sizes first, checked by every rank alike: a rank refusing alone would leave the others in the next gather)
    world = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64), group=group)
    size = max(int(x) for x in lengths)
    if size > MAX_IDENTITY_BYTES:
        raise SpdInputError(f"a rank of this job sent an identity of {size} bytes; at most {MAX_IDENTITY_BYTES} fit")
    mine = torch.zeros(size, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.zeros(size, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    identities = []
    for rank, (buf, length) in enumerate(zip(gathered, lengths)):
        try:
            identities.append(json.loads(bytes(buf[: int(length)].tolist()).decode()))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise SpdInputError(
                f"rank {rank} of this job sent an identity that is not JSON; is it running spd?"
            ) from None
    problem = mismatch(identities)
    if problem is not None:
        raise SpdInputError(problem)
