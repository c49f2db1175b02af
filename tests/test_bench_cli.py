"""spd-bench, the one command of every benchmark in spd/bench/: ``--help`` lists each with its purpose (no torch
loaded), ``NAME --help`` gives its flags, a missing or unknown NAME is one error line."""

import subprocess
import sys

from conftest import REPO, run_main
from spd.cli.bench import BENCHMARKS, main, module_of


def test_every_benchmark_is_listed_with_its_purpose():
    modules = {path.stem for path in (REPO / "spd" / "bench").glob("*.py")} - {"__init__", "__main__", "report"}
    assert sorted(module_of(name).rpartition(".")[2] for name in BENCHMARKS) == sorted(modules)
    listed = run_main(main, "--help")
    assert listed.returncode == 0
    lines = {line.split()[0]: line for line in listed.stdout.splitlines() if line.startswith("  ")}
    assert list(lines) == list(BENCHMARKS)
    assert lines["decode"].split(None, 1)[1].startswith("Benchmark decoding modes and heads on a prompt set")
    assert all(len(line.split()) > 4 and "``" not in line for line in lines.values())


def test_the_list_loads_no_torch_and_a_benchmark_gives_its_flags():
    code = "import sys; from spd.cli.bench import main; main(['--help']); print('torch' in sys.modules)"
    listed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert listed.returncode == 0 and listed.stdout.splitlines()[-1] == "False", listed.stderr
    flags = subprocess.run(
        [sys.executable, "-m", "spd.bench", "link", "--help"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert flags.returncode == 0 and flags.stdout.startswith("usage: spd-bench link [-h] [--rounds ROUNDS]")


def test_a_missing_or_unknown_benchmark_is_one_error_line():
    for argv, expected in (
        (["nope", "--out", "x.json"], "error: there is no benchmark 'nope'; expected one of decode, ar, batch,"),
        ([], "error: spd-bench needs a benchmark NAME first; expected one of decode, ar, batch,"),
        (["--run", "ar"], "error: spd-bench needs a benchmark NAME first; expected one of decode, ar, batch,"),
    ):
        proc = run_main(main, *argv)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stderr.startswith(expected), proc.stderr
