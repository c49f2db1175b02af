"""spd-convert: the SPD authors' head files <-> our directory layout.

    spd-convert heads/Qwen3.5-4B_s4_l4.pt runs/authors-4b-s4          # their .pt -> a directory
    spd-convert hf://yuyijiong/speculative_pipeline_decoding@v10/Qwen3.5-4B_s4_l4.pt runs/authors-4b-s4
    spd-convert runs/authors-4b-s4 Qwen3.5-4B_s4_l4.pt                # back to their .pt (bit-exact)
    spd-convert runs/my-head/final my-head.pt --target Qwen/Qwen3-8B   # one of our heads -> their v10 .pt

The direction follows the input: a ``.pt`` file or ``hf://`` reference becomes a directory, a converted
directory becomes a ``.pt`` file. A wrong input prints one ``error:`` line and exits with 2.

An existing output is replaced only when spd-convert wrote it (a directory holding exactly its ``config.json``
and ``model.safetensors``); anything else is refused unless ``--force``, and even then only the files
spd-convert writes are replaced: nothing else in an existing directory is removed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spd.errors import run_cli


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="spd-convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "source",
        help="an authors' .pt file, an hf://OWNER/REPO[@REV]/FILE.pt reference, or a directory written by spd-convert",
    )
    p.add_argument("out", help="the directory (from a .pt) or .pt file (from a directory) to write")
    p.add_argument("--revision", default=None, help="hub revision for an hf:// reference")
    p.add_argument("--target", default=None, help="our head -> their .pt: the head's target (directory or hub id)")
    p.add_argument(
        "--force",
        action="store_true",
        help="write over an existing output spd-convert did not write (only its own file names are "
        "replaced; nothing else is removed)",
    )
    args = p.parse_args(argv)
    from spd.cli.common import quiet_libraries

    quiet_libraries()
    return run_cli(_convert, args)


def _convert(args) -> int:
    """Convert ``args.source`` the way its kind says (our head with --target, our directory, or their file)."""
    from spd.heads.published.convert import check_output_file, head_to_authors_file, to_authors_file, to_directory

    if args.target is not None:
        from spd.heads.loading import load_speculator_config
        from spd.target.staging import StagedModel

        check_output_file(args.out, args.force)  # before the target is loaded
        n = load_speculator_config(args.source).n_stages
        out = head_to_authors_file(
            args.source, StagedModel.from_pretrained(args.target, n_stages=n), args.out, args.force
        )
    elif Path(args.source).expanduser().is_dir():
        out = to_authors_file(args.source, args.out, args.force)
    else:
        out = to_directory(args.source, args.out, args.revision, args.force)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
