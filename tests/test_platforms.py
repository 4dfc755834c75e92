"""Where the platform cannot fork (Windows): ``clustersim run`` writes its files in its own
process, ``sweep`` and ``advise`` run their plans in one process whatever ``--jobs`` asks,
and nothing refers to POSIX-only modules or calls. Approximated here by removing them before
clustersim is imported (fork, fcntl, the signal mask, the fork start method); the files must
be those a forking run writes, byte for byte (the trace file's text, where ISA-L compresses
it: conftest.compressed_alike). And the files are UTF-8 with "\n" line ends
whatever the locale's encoding (Windows': cp1252)."""

from __future__ import annotations

import subprocess
import sys

from .conftest import file_bytes
from .test_cli import run_cli, write_scenario

# as a platform without fork, fcntl or pthread_sigmask would run the command line
NO_FORK = """
import multiprocessing, os, signal, sys
sys.modules["fcntl"] = sys.modules["termios"] = None  # (an import of either fails)
del os.fork
for name in ("pthread_sigmask", "SIG_BLOCK", "SIG_SETMASK", "SIGKILL"):
    if hasattr(signal, name):
        delattr(signal, name)
multiprocessing.get_all_start_methods = lambda: ["spawn"]
context = multiprocessing.get_context
def only_spawn(method=None):
    if method == "fork":
        raise ValueError("cannot find context for 'fork'")
    return context(method)
multiprocessing.get_context = only_spawn
from clustersim.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_without_fork(*args, cwd):
    return subprocess.run([sys.executable, "-c", NO_FORK, *map(str, args)], capture_output=True, text=True, cwd=cwd)


def test_run_writes_the_same_files_without_fork(tmp_path, root):
    """A long 1F1B step (its shorter step simulated in a forked process where it can be, its
    cycle copied in) and its files (written by a forked writer where it can be)."""
    from .test_repeat import plan

    scenario = write_scenario(tmp_path, root, plan())
    r = run_without_fork("run", scenario, "--out", tmp_path / "alone", cwd=root)
    assert r.returncode == 0, r.stderr
    forked = run_cli("run", scenario, "--out", tmp_path / "forked", cwd=root)
    assert forked.returncode == 0, forked.stderr
    assert "a cycle of" in r.stdout and "a cycle of" in forked.stdout
    for name in ("summary.json", "report.html", "trace.json.gz"):
        assert file_bytes(tmp_path / "alone" / name) == file_bytes(tmp_path / "forked" / name), name


def test_a_sweep_runs_its_plans_in_one_process_without_fork(tmp_path, root):
    scenario = root / "scenarios" / "llama3_8b_8gpu.yaml"
    args = ("sweep", scenario, "--vary", "parallel.tp=2,4", "--jobs", 2)
    r = run_without_fork(*args, "--out", tmp_path / "alone", cwd=root)
    assert r.returncode == 0, r.stderr
    assert "plans in" in r.stdout and "; one process: this platform cannot fork workers for --jobs" in r.stdout
    forked = run_cli(*args, "--out", tmp_path / "forked", cwd=root)
    assert forked.returncode == 0, forked.stderr
    assert "with 2 processes" in forked.stdout
    for name in ("sweep.csv", "sweep.json"):
        assert file_bytes(tmp_path / "alone" / name) == file_bytes(tmp_path / "forked" / name), name


def test_files_are_utf8_whatever_the_locale_encoding(tmp_path, root):
    """A plan's text with other than ASCII in it (a model's name here) is written as UTF-8 with
    "\\n" line ends where the locale's encoding is not UTF-8 (ASCII here; Windows' cp1252):
    the same bytes as under UTF-8."""
    import os

    code = ("import sys\nfrom clustersim.cli import main\n"
            "sys.exit(main(['sweep', sys.argv[1], '--vary', 'model.name=Llam\\u00e4,B', '--jobs', '1', '--out', "
            "sys.argv[2]]))\n")
    scenario = root / "scenarios" / "llama3_8b_8gpu.yaml"
    outs = {}
    for name, env in (("ascii", {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}),
                      ("utf8", {"PYTHONUTF8": "1"})):
        r = subprocess.run([sys.executable, "-c", code, str(scenario), str(tmp_path / name)], cwd=root,
                           capture_output=True, env={**os.environ, **env, "PYTHONIOENCODING": "utf-8"})
        assert r.returncode == 0, r.stderr.decode()
        outs[name] = {f: (tmp_path / name / f).read_bytes() for f in ("sweep.csv", "sweep.json", "sweep.html")}
    assert "Llamä".encode() in outs["ascii"]["sweep.csv"] and b"\r\n" not in outs["ascii"]["sweep.csv"]
    assert outs["ascii"] == outs["utf8"]
