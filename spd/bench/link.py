"""Round-trip time of one runtime message between two processes (spd.runtime.link.Link over gloo).

    torchrun --nproc-per-node 2 -m spd.bench link [--rounds 2000] [--hidden 128] [--rows 1]

Rank 0 sends a token-sized message (header + (rows, 1, hidden) payload) to rank 1, which sends it back;
rank 0 prints the mean round trip and the time spent inside ``send`` and ``recv`` per message.
"""

from __future__ import annotations

import time

from spd.bench.report import argument_parser


def main(argv: list[str] | None = None) -> int:
    p = argument_parser("link", __doc__)
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--rows", type=int, default=1)
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    from spd.runtime.link import Link
    from spd.runtime.protocol import DATA_TAG, TOKEN, RuntimeConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    link = Link(rank, RuntimeConfig(), torch.float32, torch.device("cpu"), args.hidden)
    payload = torch.randn(args.rows, 1, args.hidden)
    send_s = recv_s = 0.0
    dist.barrier()
    start = time.perf_counter()
    for i in range(args.rounds):
        for step in (0, 1) if rank == 0 else (1, 0):
            tick = time.perf_counter()
            if step == 0:
                link.send(peer, DATA_TAG, TOKEN, 0, i, payload)
                send_s += time.perf_counter() - tick
            else:
                link.recv(peer, DATA_TAG)
                recv_s += time.perf_counter() - tick
    elapsed = time.perf_counter() - start
    link.drain_sends()
    dist.barrier()
    if rank == 0:
        print(
            f"round trip {elapsed / args.rounds * 1e6:.0f} us; per message: send {send_s / args.rounds * 1e6:.0f} us, "
            f"recv (waiting included) {recv_s / args.rounds * 1e6:.0f} us",
            flush=True,
        )
    dist.destroy_process_group()
    return 0
