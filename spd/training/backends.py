"""The trainer's accelerate set-up for its multi-process back-ends (DDP, DeepSpeed ZeRO-2, FSDP2), on GPUs and on CPU.

``accelerate launch`` starts the processes and says which back-end it wants in environment variables
(``ACCELERATE_USE_DEEPSPEED``, ``ACCELERATE_USE_FSDP`` and their settings); :func:`make_accelerator` builds the
``Accelerator`` from them. On GPUs that is plain ``Accelerator(...)``. Without CUDA, accelerate (1.x) sets up
neither sharded back-end: DeepSpeed's processes get no ``torch.distributed`` backend (each believes it is alone,
and DeepSpeed stops at its batch-size check), and FSDP is switched on only for accelerators (each process trains
alone, silently). On CPU this module gives DeepSpeed gloo, and gives FSDP accelerate's multi-CPU (gloo) process
group with its FSDP plugin switched on, so that both run as they would on GPUs (docs/training.md, "Multi-process
back-ends").
"""

from __future__ import annotations

import os

import torch

from ..errors import SpdInputError


def launched_backend() -> str | None:
    """``"deepspeed"`` or ``"fsdp"`` if ``accelerate launch`` started that back-end in several processes, else None."""
    if int(os.environ.get("WORLD_SIZE") or 1) < 2:
        return None
    for name in ("deepspeed", "fsdp"):
        if os.environ.get(f"ACCELERATE_USE_{name.upper()}", "false").lower() == "true":
            return name
    return None


def cpu_threads(threads: int | None, device: torch.device) -> int | None:
    """The intra-op threads one training process uses on a CPU, or None to keep torch's (from ``OMP_NUM_THREADS``).

    ``threads`` (the config's) when set. Otherwise, under ``accelerate launch``, which gives every process
    ``OMP_NUM_THREADS=1`` unless told otherwise and so leaves a CPU's other cores idle (a SmolLM2 step took 1.6x as
    long on 2 cores), the cores this process may use divided by the processes on this machine; a value other than 1,
    or a run not started by accelerate, is kept. On a GPU only ``threads`` changes it."""
    if threads is not None:
        return threads
    launched = "ACCELERATE_MIXED_PRECISION" in os.environ  # set by accelerate launch for every process it starts
    if device.type != "cpu" or not launched or os.environ.get("OMP_NUM_THREADS") != "1":
        return None
    import psutil  # an accelerate dependency

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores = min(cores, psutil.cpu_count(logical=False) or cores)  # one thread per physical core
    here = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)  # processes on this machine (torchrun sets it)
    return max(1, cores // here)


def make_accelerator(max_grad_norm: float | None = None, **kwargs):
    """``Accelerator(**kwargs)`` for the launched back-end, on GPUs or CPU (see the module docstring).

    ``max_grad_norm`` fills a DeepSpeed config's ``gradient_clipping: "auto"`` (DeepSpeed clips inside its
    step; accelerate would otherwise fill in 1.0 whatever the trainer asks for).
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cpu_backend = None if torch.cuda.is_available() else launched_backend()
    if cpu_backend == "deepspeed":
        # The backend DeepSpeed's CPU accelerator uses without oneCCL; without it accelerate passes none.
        kwargs["kwargs_handlers"] = [*kwargs.get("kwargs_handlers", []), InitProcessGroupKwargs(backend="gloo")]
    elif cpu_backend == "fsdp":
        os.environ["ACCELERATE_USE_CPU"] = "true"  # accelerate's multi-CPU set-up: gloo, ranks from the launcher
    accelerator = Accelerator(**kwargs)
    if cpu_backend == "fsdp":
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        # Every AcceleratorState() re-reads the type from PartialState's shared state, so set it there too.
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* variables
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and max_grad_norm is not None and plugin.deepspeed_config.get("gradient_clipping") == "auto":
        plugin.deepspeed_config["gradient_clipping"] = float(max_grad_norm)
    world = int(os.environ.get("WORLD_SIZE") or 1)
    if world != accelerator.num_processes:
        raise SpdInputError(
            f"the launcher started {world} processes, but accelerate sees {accelerator.num_processes} "
            f"(distributed type {accelerator.distributed_type.value}): each would train alone and "
            "overwrite the others' files; launch with a config this machine supports "
            "(docs/training.md, 'Multi-process back-ends')"
        )
    return accelerator


def plain_head(accelerator, head):
    """The trained head as a plain module holding all its weights, on the main process; None on the others.

    Under FSDP the weights are sharded across the processes, so every process must call this (it gathers them);
    elsewhere it is ``unwrap_model`` (ZeRO-2 shards gradients and optimizer state, not weights).
    """
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.FSDP:
        return accelerator.unwrap_model(head) if accelerator.is_main_process else None
    state = accelerator.get_state_dict(head)  # the full state dict on the main process (collective)
    if not accelerator.is_main_process:
        return None
    from ..heads.speculator import Speculator

    config = accelerator.unwrap_model(head).config
    with torch.device("meta"):
        whole = Speculator(config)
    whole.load_state_dict(state, assign=True)
    return whole
