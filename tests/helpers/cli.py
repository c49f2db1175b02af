"""spd-generate as a user runs it: the installed console script in a fresh process, or its main in this one."""

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO, run_main


def spd_generate_command() -> list[str]:
    script = Path(sys.executable).parent / "spd-generate"
    if script.exists():
        return [str(script)]
    found = shutil.which("spd-generate")
    return [found] if found else [sys.executable, "-m", "spd.cli.generate"]


def spd_generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*spd_generate_command(), *args], capture_output=True, text=True, timeout=300, cwd=REPO)


def spd_generate_main(*args: str) -> subprocess.CompletedProcess:
    """spd-generate's main in this process (wrong-input cases: no fresh interpreter needed to see the error line)."""
    from spd.cli.generate import main

    return run_main(main, *args)
