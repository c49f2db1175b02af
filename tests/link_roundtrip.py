"""Run by tests/test_runtime.py under torchrun (2 processes): messages of every size, inline and spilled, arrive
intact and in order, with their header fields, extras and dtypes: each sent with its own bytes into a larger posted
receive (gloo's links) and padded to the slot (NCCL's links, run here over gloo)."""

import sys

import torch
import torch.distributed as dist

from spd.runtime.link import Link
from spd.runtime.protocol import DATA_TAG, STOP, TOKEN, RuntimeConfig


def messages(hidden: int, inline: int, dtype: torch.dtype):
    itemsize = torch.empty(0, dtype=dtype).element_size()
    rows_inline = inline // (hidden * itemsize)
    gen = torch.Generator().manual_seed(0)
    for i, (rows, n_extra) in enumerate(
        [
            (0, 0),
            (1, 0),
            (1, 3),
            (rows_inline, 0),
            (rows_inline + 1, 0),
            (0, inline // 8 + 1),
            (3 * rows_inline, 17),
            (2, 5),
            (0, 0),
        ]
    ):
        payload = torch.randn(rows, 1, hidden, generator=gen).to(dtype) if rows else None
        extra = torch.randint(-(2**40), 2**40, (n_extra,), generator=gen) if n_extra else None
        yield i, payload, extra


def main() -> int:
    dist.init_process_group("gloo")
    rank, hidden = dist.get_rank(), 48
    for dtype, backend in ((torch.float32, "gloo"), (torch.bfloat16, "gloo"), (torch.float32, "nccl")):
        link = Link(rank, RuntimeConfig(timeout_s=30, backend=backend), dtype, torch.device("cpu"), hidden)
        assert link.padded == (backend == "nccl")
        for i, payload, extra in messages(hidden, link.inline, dtype):
            if rank == 0:
                link.send(1, DATA_TAG, TOKEN, 7, i, payload, stage=3, extra=extra)
                continue
            header, got_extra, got = link.recv(0, DATA_TAG)
            assert header[:3] == [TOKEN, 7, i] and header[4] == 3, header
            assert (got is None) == (payload is None) and (got_extra is None) == (extra is None), i
            assert got is None or (got.dtype == dtype and torch.equal(got, payload)), i
            assert got_extra is None or torch.equal(got_extra, extra), i
        if rank == 0:
            link.send(1, DATA_TAG, STOP, 7, 0)
        else:
            assert int(link.recv(0, DATA_TAG)[0][0]) == STOP
        link.drain_sends()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
