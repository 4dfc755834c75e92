"""Command line: ``python -m clustersim run | compare | sweep | advise | schedule | validate | schema | collective``.

    python -m clustersim run scenarios/gpt3_175b_1024gpu.yaml --out out/gpt3
    python -m clustersim compare scenarios/llama2_70b_64gpu.yaml --variant "parallel.pp=1 parallel.dp=8 parallel.zero=3"
    python -m clustersim sweep scenarios/llama2_70b_64gpu.yaml --vary parallel.tp=2,4,8 --vary parallel.pp=1,2,4,8
    python -m clustersim schedule --pp 4 --microbatches 8 --schedule 1f1b
    python -m clustersim schedule --pp 4 -m 8 --schedule interleaved --vpp 2
    python -m clustersim schedule --schedule custom --file scenarios/schedules/custom_1f1b_4x8.txt
    python -m clustersim validate scenarios/*.yaml
    python -m clustersim schema
    python -m clustersim collective --topology topologies/dgx-h100.yaml --op all_reduce --gpus 8 --sizes 1M,1G

Bad input prints one line naming the file and field, exits with 2, and writes nothing; so
does an output that cannot be written (``--out`` on a full disk, a standard output that
fails: ``> /dev/full``).
A simulated step that breaks an invariant (a simulator bug, docs/invariants.md) prints the
violations, exits with 3, and writes nothing; ``run --no-check`` skips the checks.
Ctrl-C stops every process of the run, writes nothing (unless the files were in place
already, which it says) and exits with 130; SIGTERM (kill, timeout, Slurm) does the same and
exits with 143.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from .errors import ConfigError, Terminated, raise_terminated

EXIT_BAD_INPUT = 2
EXIT_INVARIANT = 3  # the simulated step broke an invariant: a simulator bug (docs/invariants.md)
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report a process SIGINT ended (128 + 2)
EXIT_TERMINATED = 143  # SIGTERM (128 + 15)
OUTPUT_FILES = ("summary.json", "report.html", "trace.json.gz")
# run --trace-gpus writes at most this many spans: Perfetto parses a JSON trace in the browser
# tab, a few million events at most (every GPU of moe_1024gpu: 2.1 million, a 33 MB file;
# gpt3_175b_1024gpu's: 15 million, about 230 MB)
TRACE_GPUS_MAX_SPANS = 5_000_000
STAGING_PREFIX = ".clustersim-"  # the run's temp folder, inside the output folder until the files move in


class StreamError(OSError):
    """An OSError writing the standard output or error (``> /dev/full``, a full disk under a
    redirection), raised by :class:`_Guarded` so that the command line tells it from an
    OSError of anything else; ``stream``: "stdout" or "stderr"."""

    def __init__(self, exc: OSError, stream: str):
        super().__init__(exc.errno, exc.strerror)
        self.stream = stream


class _Guarded:
    """``sys.stdout`` or ``sys.stderr`` while a command runs (:func:`main`): what it cannot
    write raises :class:`StreamError` (a broken pipe stays BrokenPipeError, which the
    command line answers as ``head`` expects); everything else is the stream's own."""

    def __init__(self, stream, name: str):
        self._stream, self._name = stream, name

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise StreamError(exc, self._name) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise StreamError(exc, self._name) from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def _guarded_streams() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` as :class:`_Guarded` while the block runs."""
    before = sys.stdout, sys.stderr
    if sys.stdout is not None:
        sys.stdout = _Guarded(sys.stdout, "stdout")
    if sys.stderr is not None:
        sys.stderr = _Guarded(sys.stderr, "stderr")
    try:
        yield
    finally:
        sys.stdout, sys.stderr = before


OUT_NAME_MAX = 120  # characters of a default folder's name
# how run --set and compare --variant read a change's value (clustersim.overrides)
_VALUES_HELP = ("a value is read as YAML; null removes the key, but under cluster.node and cluster.fabric sets "
                "the topology's field to null, its default")


def _default_out(scenario: str, changes: list[tuple[str, object]] = ()) -> Path:
    """``out/<stem>``, or with ``run --set`` changes ``out/<stem>+<key>=<value>+...``, so that
    a changed run leaves the file's own outputs in place. Where the changes' words hold
    characters a folder name should not (spaces, slashes, quotes, brackets, a trailing dot),
    runs of them become ``_`` and a checksum of the words ends the name, so that changes
    cleaned alike do not share a folder; a name past :data:`OUT_NAME_MAX` characters is cut
    and ends so too::

        llama2_70b_64gpu.yaml --set "parallel.pp=8 parallel.dp=1"
            -> out/llama2_70b_64gpu+parallel.pp=8+parallel.dp=1
        x.yaml --set "'cluster.what_if=[{gpu: 5, slowdown: 1.2}]'"
            -> out/x+cluster.what_if=_gpu_5_slowdown_1.2_~3b0cbe10
    """
    import zlib

    from .overrides import change_words

    name = Path(scenario).stem
    if not changes:
        return Path("out") / name
    words = change_words(changes)
    clean = [re.sub(r"[^A-Za-z0-9._=-]+|\.+$", "_", w) for w in words]
    full = "+".join([name, *clean])
    if clean != words or len(full) > OUT_NAME_MAX:
        full = f"{full[:OUT_NAME_MAX - 9]}~{zlib.crc32(chr(0).join([name, *words]).encode()):08x}"
    return Path("out") / full


class _Staging:
    """The run's files are written into a fresh hidden temp folder inside ``out`` and moved in at
    the end: nothing is left half-written, and a run that fails (a broken invariant, an
    interrupt, a full disk) leaves neither files nor the folders it made for them.

    The temp folder is locked while the command runs (:func:`_hold_folder`), and making one
    removes those of the same kind in ``out`` that no process holds: what a run killed by
    SIGKILL (or a machine that went down) left. A command running into the same folder holds
    its own, which is left alone."""

    def __init__(self, out: Path, files: tuple[str, ...] = OUTPUT_FILES, ours: str | None = None):
        self.out, self.files, self.tmp, self.made, self.moved = out, files, None, [], False
        self.ours = re.compile(ours) if ours else None  # names of files an earlier command wrote, stale if not now
        self.lock: int | None = None  # the temp folder's descriptor, which holds its lock

    def folder(self) -> Path:
        if self.tmp is None:
            # inside ``out``, so that the files move in on one file system (next to it, an
            # ``out`` that links or mounts elsewhere failed the move after the whole run)
            self.made = [d for d in (self.out, *self.out.parents) if not d.exists()]
            self.out.mkdir(parents=True, exist_ok=True)
            self.tmp, self.lock = _held_temp_folder(self.out)
            _remove_stale(self.out, self.tmp)
        return self.tmp

    def move_in(self) -> list[Path]:
        tmp, out = self.folder(), self.out
        written, done = [], []
        try:
            for name in self.files:  # a file of an earlier run that this run did not write is stale
                if (tmp / name).exists():
                    os.replace(tmp / name, out / name)
                    written.append(out / name)
                    done.append(name)
                else:
                    (out / name).unlink(missing_ok=True)
        except OSError as exc:
            exc.moved = done  # (said by moved_in: the folder then holds these of this run)
            raise
        if self.ours is not None:  # (an earlier compare of more plans wrote more reports)
            for p in sorted(out.iterdir()):
                if self.ours.fullmatch(p.name) and p.name not in self.files and p.is_file():
                    p.unlink()
        self.moved = True
        return sorted(written)

    def opened(self) -> Path:
        """:meth:`folder`, a folder that cannot be made said as bad input (``--out``)."""
        try:
            return self.folder()
        except OSError as exc:
            raise ConfigError(f"cannot write in {self.out}: {exc.strerror or exc}", source="command line",
                              field="--out") from None

    def moved_in(self, args=None) -> list[Path]:
        """:meth:`move_in`, a failure the checks before the run cannot foresee (a disk gone
        read-only) said as bad input (``--out``). Each file moves in by an ``os.replace`` of its
        own: Ctrl-C and SIGTERM are held back until every one is in place and ``args.written``
        says so, so that an interrupt cannot leave some files of this run beside some of the
        one before (it then says the outputs are written)."""
        from .forking import ctrl_c_held

        with ctrl_c_held():
            with self.writing(), _moving_in(self.out):
                written = self.move_in()
            if args is not None:
                args.written = self.out
        return written

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """The block writes into the temp folder (or moves its files in): an OSError there, which
        no check before the run can foresee (a full disk, the output folder deleted meanwhile),
        said as bad input (``--out``), one line instead of a traceback."""
        try:
            yield
        except StreamError:  # (the terminal's, not the folder's: _run says it)
            raise
        except OSError as exc:
            moved = getattr(exc, "moved", None)
            partly = f"; only {', '.join(moved)} of this run moved in" if moved else ""
            raise ConfigError(f"cannot write the outputs into {self.out}: {exc.strerror or exc}{partly}",
                              source="command line", field="--out") from None

    def clean(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if self.lock is not None:  # (after the folder is gone: no other command takes it for stale meanwhile)
            os.close(self.lock)
            self.lock = None
        if not self.moved:
            for d in self.made:  # deepest first
                try:
                    d.rmdir()
                except OSError:
                    break


# a temp folder as tempfile.mkdtemp names it (its 8 characters), which _remove_stale may remove
_STAGED = re.compile(re.escape(STAGING_PREFIX) + r"[a-z0-9_]{8}")


def _hold_folder(path: Path) -> int | None:
    """A descriptor of the folder ``path`` holding an exclusive lock on it (``flock``: the
    kernel drops it once every process holding the descriptor has ended, by SIGKILL too, the
    forked ones included); None where this platform (Windows) or file system gives no such
    lock. OSError where the folder is gone or not one, BlockingIOError where another process
    holds the lock."""
    try:
        import fcntl
    except ImportError:
        return None
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise
    except OSError:  # (no locks on this file system: ENOLCK, EOPNOTSUPP)
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def _moving_in(out: Path) -> Iterator[None]:
    """One command at a time moves its files into ``out`` (a lock on the folder, waited for:
    a move takes milliseconds), so that two commands writing into one folder leave the files
    of one of them, not some of each; nothing held where :func:`_hold_folder` has no lock."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(out, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # (no locks on this file system: moved in unheld)
            pass
        yield
    finally:
        os.close(fd)


def _held_temp_folder(out: Path) -> tuple[Path, int | None]:
    """A fresh temp folder in ``out`` and the descriptor that holds its lock (None: no lock
    to be had here). Another command's :func:`_remove_stale` may take it for stale between
    its making and its lock, and remove it: then a fresh one is made."""
    while True:
        tmp = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out))
        try:
            fd = _hold_folder(tmp)
        except (BlockingIOError, FileNotFoundError):  # held by the command removing it, or gone already
            continue
        if fd is None:
            return tmp, None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(tmp)):
                return tmp, fd
        except OSError:  # locked once the other command had removed it and let go
            pass
        os.close(fd)


def _remove_stale(out: Path, own: Path) -> None:
    """Remove the temp folders in ``out`` (:data:`_STAGED`, not links) whose lock no process
    holds: a command that ended without cleaning up (SIGKILL) left them. Locked here while
    removed, so a command that just made one of the same name (:func:`_held_temp_folder`) makes
    another; left where there is no lock to tell (:func:`_hold_folder`)."""
    try:
        names = [p for p in out.iterdir() if _STAGED.fullmatch(p.name) and p.name != own.name]
    except OSError:
        return
    for p in names:
        try:
            fd = _hold_folder(p)
        except OSError:  # in use, gone, a link or not a folder
            continue
        if fd is None:  # (no lock to be had here: none can be told stale)
            return
        try:
            shutil.rmtree(p, ignore_errors=True)
        finally:
            os.close(fd)


def _out_problem(out: Path, files: tuple[str, ...] = OUTPUT_FILES) -> str | None:
    """Why the command's ``files`` (the run's) cannot go into the folder ``out`` (made if it is
    not there), found before the step is simulated; None if nothing is in the way."""
    if any(len(os.fsencode(part)) > 255 for part in out.parts):  # NAME_MAX of Linux and macOS file systems
        return f"a folder name in {str(out)[:48]}... is longer than 255 bytes"
    if out.is_symlink() and not out.exists():
        return f"{out} is a link to nothing; give a folder for {', '.join(files)}"
    if out.exists() and not out.is_dir():
        return f"{out} is a file; give a folder for {', '.join(files)}"
    if out.is_dir():
        if not os.access(out, os.W_OK | os.X_OK):
            return f"cannot write in {out} ({'read-only file system' if _read_only(out) else 'permission denied'})"
        for name in files:  # os.replace cannot put a file where a folder is
            if (out / name).is_dir():
                return f"{out / name} is a folder; the run writes a file of that name"
        return None
    for d in out.parents:  # the deepest one there must be a folder
        if d.exists():
            return None if d.is_dir() else f"{d} is a file, not a folder"
    return None


def _read_only(folder: Path) -> bool:
    """Whether ``folder`` is on a file system mounted read-only (where :func:`os.access` says
    it cannot be written, the cause to name: no permission would help)."""
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (AttributeError, OSError):  # (Windows has no statvfs)
        return False


def _given_scenario(path: str) -> None:
    """Refuse an empty scenario path (Path("") is the current folder)."""
    if not path:
        raise ConfigError("the scenario file's path is empty", source="command line", field="scenario")


def gpu_list(spec: str, world: int) -> list[int]:
    """The GPUs ``run --trace-gpus`` names: ``all``, or numbers and ranges ``a-b`` (both ends
    included) joined by commas, each within the world of ``world`` GPUs; ascending, once each::

        "0-3,517,2"    [0, 1, 2, 3, 517]
    """
    field = "--trace-gpus"
    if spec.strip().lower() == "all":
        return list(range(world))
    if not spec.strip():
        raise ConfigError("is empty: give GPUs (e.g. 0-7,517) or all", source="command line", field=field)
    gpus: set[int] = set()
    for item in spec.split(","):
        m = re.fullmatch(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?", item)
        if m is None:
            raise ConfigError(f"{item.strip()!r} is not a GPU or a range of GPUs (give e.g. 0-7,517 or all)",
                              source="command line", field=field)
        if m.group(2) is not None and int(m.group(2)) < int(m.group(1)):
            raise ConfigError(f"{item.strip()!r} runs downwards; write {m.group(2)}-{m.group(1)}",
                              source="command line", field=field)
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi >= world:
            raise ConfigError(f"GPU {hi} is not in this cluster of {world:,} GPUs (0-{world - 1})",
                              source="command line", field=field)
        gpus.update(range(lo, hi + 1))
    return sorted(gpus)


def cmd_run(args) -> int:
    from .api import no_cyclic_gc, simulate
    from .config import load_scenario
    from .forking import ctrl_c_held
    from .output import background
    from .output.summary import format_summary, to_json

    _given_scenario(args.scenario)
    if args.out == "":  # (not "no --out": a script's unset variable, say)
        raise ConfigError("the output folder's path is empty; leave --out out for out/<scenario name>",
                          source="command line", field="--out")
    # the schedule's check is simulate's: after it forks the process that simulates a shorter
    # step, which needs no whole schedule (clustersim.engine.ahead)
    changes = []
    if args.set:
        sc, changes = _with_changes(args.scenario, args.set)
    else:
        sc = load_scenario(args.scenario, check_schedule=False)
    out = Path(args.out) if args.out is not None else _default_out(args.scenario, changes)
    if ".." in out.parts:  # o2/.. with o2 not there: the folder meant, not an o2 made on the way
        out = out.resolve()
    trace_gpus = None
    if args.trace_gpus is not None:
        if args.no_trace:
            raise ConfigError("names the GPUs of trace.json.gz, which --no-trace leaves out: give one or the other",
                              source="command line", field="--trace-gpus")
        trace_gpus = gpu_list(args.trace_gpus, sc.mesh.world_size)
    # with --trace-gpus the trace file is written once the summary is, by this process
    files = {"report": not args.no_report, "trace_file": not args.no_trace and trace_gpus is None}
    staging = _Staging(out)
    writer = None

    def after_run(trace, link_use, checks):  # the report and the trace file, written while the summary is made
        nonlocal writer
        if any(files.values()):
            # (on the largest clusters the parent works the link use out faster itself)
            if sc.mesh.world_size >= background.PARENT_LINK_USE_GPUS:
                link_use = None
            with staging.writing():  # (its counters' file: the output folder deleted meanwhile)
                writer = background.start(staging.folder(), trace, link_use=link_use, checks=checks, **files)
        return writer

    problem = _out_problem(out)
    if problem is not None:
        raise ConfigError(problem, source="command line", field="--out")
    try:
        staging.opened()  # the temp folder now, so that a folder the files cannot go to is said before the run
        t0 = time.perf_counter()
        result = simulate(sc, collapse=False if args.all_ranks else None, repeat=False if args.no_repeat else None,
                          check=not args.no_check, after_run=after_run, keep=args.keep, fork=True)
        if args.keep is not None:
            args.keep.append(result)
        wall_s = time.perf_counter() - t0
        with no_cyclic_gc(), staging.writing():  # the outputs walk every span once more, see api.no_cyclic_gc
            tmp = staging.folder()
            # (UTF-8 and "\n" as they are: the same bytes on every platform, not cp1252 and CRLF on Windows)
            (tmp / "summary.json").write_text(to_json(result.summary), encoding="utf-8", newline="")
            background.complete(writer, tmp, result.trace, result.summary, **files)
            if trace_gpus is not None:
                _write_gpus_trace(tmp / "trace.json.gz", result, trace_gpus)
            result.finish_checks()  # those the writer took (a violation: nothing is moved in)
            written = staging.moved_in(args)  # (an interrupt from now on says the files are there)
        print(format_summary(result.summary))
        print(_simulated_line(result.summary, wall_s))
        print(f"{'wrote':<16}" + ", ".join(str(p) for p in written))
        return 0
    except ConfigError as exc:
        if exc.field != "collapse=False":
            raise
        raise ConfigError(exc.message, source=exc.source, field="--all-ranks") from None  # simulate's collapse=False
    finally:
        with ctrl_c_held():  # a second Ctrl-C or SIGTERM (said once this is done) lets the clean-up finish
            if writer is not None:
                writer.cancel()
            staging.clean()


def _with_changes(path: str, given: list[str], check_schedule: bool = False):
    """``run --set`` (and ``validate --set``): the scenario of ``path`` with the changes of
    every ``--set`` (in order), described by them (unless they set the description), and the
    changes; its schedule checked with ``check_schedule`` (``run`` checks it later)."""
    from .overrides import load_variant, parse_changes, variant_source

    changes = [c for text in given for c in parse_changes(text, source="command line", field=f"--set {text!r}")]
    keys = {k for k, _ in changes}
    described = [] if "description" in keys else [("description", variant_source(path, changes))]
    return load_variant(path, changes, unnamed=described, check_schedule=check_schedule), changes


def cmd_compare(args) -> int:
    """Simulate every plan given (the files, then the first file with each ``--variant``'s
    changes), all checked before the first is simulated; print them side by side and, with
    ``--out``, write compare.json (clustersim.output.compare), compare.html
    (clustersim.output.compare_page) and each plan's report, as ``run`` writes it, named by
    the plan's label; nothing is moved in before all are done."""
    from .hardware.topology import reused_clusters

    with reused_clusters():  # (plans on one topology share its cluster: built once)
        return _compare(args)


def _compare(args) -> int:
    """:func:`cmd_compare`'s work."""
    from .api import simulate
    from .config import load_scenario
    from .forking import ctrl_c_held
    from .output.compare import (COMPARE_FILE, REPORT_NAMES, compare_json, config_differences, effective_config,
                                 format_compare, labels, report_name)
    from .output.compare_page import COMPARE_PAGE, compare_html, timeline_caption
    from .output.report import as_sent, script_json, report_html, timeline
    from .output.summary import to_json, wall_said
    from .overrides import load_variant, parse_changes, variant_source
    from .yamlio import read_yaml

    for path in args.scenarios:
        _given_scenario(path)
    variants = args.variant or []
    names = labels(len(args.scenarios) + len(variants))
    if len(names) < 2:
        raise ConfigError("compare needs two plans or more: give another scenario file, or the first one's changes "
                          "with --variant (e.g. --variant \"parallel.pp=1 parallel.zero=3\")", source="command line",
                          field="scenarios")
    files = (COMPARE_FILE, COMPARE_PAGE, *(report_name(label) for label in names))
    if args.no_report and args.out is None:
        raise ConfigError("leaves out the plans' reports, which only --out writes: give --out or drop --no-report",
                          source="command line", field="--no-report")
    out = _given_out(args.out, files)
    plans = [{"label": names[i], "source": path, "file": path, "changes": None, "scenario": load_scenario(path)}
             for i, path in enumerate(args.scenarios)]
    first = args.scenarios[0]
    data = read_yaml(Path(first), what="scenario") if variants else None  # (read once for every variant)
    for label, text in zip(names[len(args.scenarios):], variants):
        changes = parse_changes(text, source="command line", field=f"--variant {text!r}")
        source = variant_source(first, changes)
        # its summary and report say which variant it is, not the file's own plan
        keys = dict(changes)
        named = [(k, v) for k, v in (("name", f"{plans[0]['scenario'].cfg.name} ({label})"), ("description", source))
                 if k not in keys]
        plans.append({"label": label, "source": source, "file": first, "changes": keys,
                      "scenario": load_variant(first, changes, data, unnamed=named)})
    base_cfg = effective_config(plans[0]["scenario"])
    # reports of an earlier compare of more plans are stale; a folder that holds no compare.json
    # holds none of its reports, so files named as they are stay
    ours = REPORT_NAMES if out is not None and (out / COMPARE_FILE).is_file() else None
    staging = _Staging(out, files, ours) if out is not None else None
    walls = []
    written = []
    timelines: list = []  # per plan, for compare.html: its timeline's data (JSON), layout, caption and spans
    try:
        if staging is not None:
            staging.opened()  # (a folder the files cannot go to is said before the plans are simulated)
        for p in plans:
            sc = p.pop("scenario")
            p["differences"] = config_differences(base_cfg, effective_config(sc))
            t0 = time.perf_counter()
            result = simulate(sc, fork=True)
            walls.append(time.perf_counter() - t0)
            p["summary"] = result.summary
            if p["changes"] is None:  # a file's plan is named by its label too, as a variant is (its report's title)
                result.summary["scenario"] = f"{result.summary['scenario']} ({p['label']})"
            if staging is not None and not args.no_report:
                # each plan's report, as run writes it, and its timeline for compare.html: one figure for both
                fig = as_sent(timeline(result.trace, result.summary))
                data_json = script_json(fig["data"])
                with staging.writing():
                    (staging.folder() / report_name(p["label"])).write_text(
                        report_html(result.trace, result.summary, fig, data_json,
                                    (("compare.html", "every plan side by side"),)), encoding="utf-8", newline="")
                # (each plan's, the page picks: the data already JSON, a few MB at most)
                timelines.append((data_json, fig["layout"], timeline_caption(result.trace, fig["layout"]),
                                  fig.get("detail")))
            del result
        if staging is not None:
            with staging.writing():
                (staging.folder() / COMPARE_FILE).write_text(to_json(compare_json(plans)), encoding="utf-8",
                                                             newline="")
                if not args.no_report:
                    (staging.folder() / COMPARE_PAGE).write_text(compare_html(plans, timelines, reports=True),
                                                                 encoding="utf-8", newline="")
            written = staging.moved_in(args)
    finally:
        if staging is not None:
            with ctrl_c_held():
                staging.clean()
    print(format_compare(plans))
    print(f"{'simulated':<24}" + " · ".join(f"{p['label']} in {wall_said(w)}" for p, w in zip(plans, walls)))
    if written:
        print(f"{'wrote':<24}" + ", ".join(map(str, written)))
    return 0


def cmd_advise(args) -> int:
    """Search the plans around the guide's options for the scenario, simulate and rank them,
    check the guide's rule; with ``--out``, write advise.json, advise.csv (clustersim.advise) and
    advise.html (clustersim.output.plans_page)."""
    from .advise import ADVISE_FILES, format_advice, run_advise
    from .sweep import parse_vary

    _given_scenario(args.scenario)
    varies = [parse_vary(v, source="command line") for v in args.vary or []]
    return _search(args, varies, ADVISE_FILES, "search", 12,
                   lambda jobs, progress: run_advise(args.scenario, varies, jobs=jobs, progress=progress,
                                                     prune=not args.simulate_unfit), format_advice)


def _search(args, varies: list, files: tuple[str, str, str], what: str, width: int, run, fmt) -> int:
    """What ``sweep`` and ``advise`` share: their options checked, the plans simulated (``run``,
    with ``--jobs`` processes and a progress line on a terminal), the table printed (``fmt``),
    then ``files`` (the JSON and the CSV of every plan, and the page of them all,
    clustersim.output.plans_page) written with ``--out``."""
    from .forking import ctrl_c_held, pool_forks
    from .output.plans_page import plans_html
    from .output.summary import to_json, wall_said
    from .overrides import repeats
    from .sweep import sweep_csv

    src = "command line"
    twice = repeats([k for k, _ in varies])
    if twice:
        raise ConfigError(f"{twice[0]} is varied twice; give its values in one --vary", source=src, field="--vary")
    for flag, value in (("--jobs", args.jobs), ("--top", args.top)):
        if value is not None and value < 1:
            raise ConfigError(f"must be at least 1 (got {value})", source=src, field=flag)
    out = _given_out(args.out, files)
    tty = sys.stderr.isatty()
    if _splits_replicas(args.scenario, varies):  # (said before the plans run: they may take long)
        print("note: simulation.split_replicas: each plan simulates each DP replica apart (pp x dp ranks), "
              "minutes and gigabytes a plan where DP is large; it is a check of one plan", file=sys.stderr)

    before: list[int] = []  # the rows there before the first plan's (refused plans)

    def progress(done: int, total: int) -> None:
        before[:] = before or [done - 1]
        line = progress_line(done, total, done - before[0], time.perf_counter() - t0)
        print(f"\r{line}\033[K", end="", file=sys.stderr, flush=True)

    jobs = _processes(args.jobs)
    t0 = time.perf_counter()
    found = run(jobs, progress if tty else None)
    wall_s = time.perf_counter() - t0
    if tty:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    text = fmt(found, args.top)
    print(text)
    unfit = sum(1 for r in found["plans"] if r["status"] == "unfit")
    failed = sum(1 for r in found["plans"] if r["status"] == "failed")
    if not found["ranking"] and not unfit:  # (every plan certain not to fit is an answer: none fits)
        print(f"error: no plan of the {what} could be simulated; nothing written", file=sys.stderr)
        return EXIT_BAD_INPUT
    done = len(found["ranking"])
    print(f"{'simulated':<{width}}{done:,} plan{'s' if done != 1 else ''} in {wall_said(wall_s)}"
          + (f" with {jobs} processes" if jobs > 1 else "; one process: this platform cannot fork workers for --jobs"
             if args.jobs != 1 and (os.cpu_count() or 1) > 1 and not pool_forks() else "")
          + (f"; {unfit:,} certain not to fit" if unfit else "")
          + (f"; {failed:,} ended without a result (worker killed)" if failed else ""))
    if out is not None:
        staging = _Staging(out, files)
        try:
            tmp = staging.opened()
            with staging.writing():
                (tmp / files[0]).write_text(to_json(found), encoding="utf-8", newline="")
                (tmp / files[1]).write_text(sweep_csv(found), encoding="utf-8", newline="")
                (tmp / files[2]).write_text(plans_html(found, text, args.command), encoding="utf-8", newline="")
            written = staging.moved_in(args)
        finally:
            with ctrl_c_held():
                staging.clean()
        print(f"{'wrote':<{width}}" + ", ".join(map(str, written)))
    return 0


def _processes(jobs: int | None) -> int:
    """``--jobs``, at most the machine's CPUs (None: all of them): more processes than cores
    only share them, and each holds a plan's memory. One where the platform cannot fork the
    workers (Windows: forking.pool_forks)."""
    from .forking import pool_forks

    cpus = (os.cpu_count() or 1) if pool_forks() else 1
    return cpus if jobs is None else min(jobs, cpus)


def _given_out(given: str | None, files: tuple[str, ...]) -> Path | None:
    """The folder ``--out`` names (None where not given), refused where ``files`` cannot go
    into it."""
    if given is None:
        return None
    if given == "":
        raise ConfigError("the output folder's path is empty", source="command line", field="--out")
    out = Path(given).resolve() if ".." in Path(given).parts else Path(given)
    problem = _out_problem(out, files)
    if problem is not None:
        raise ConfigError(problem, source="command line", field="--out")
    return out


MAX_SWEEP_PLANS = 100_000  # a sweep's combinations; each plan's row is kept until the end


def _splits_replicas(path: str, varies: list) -> bool:
    """Whether the scenario at ``path`` sets ``simulation.split_replicas`` or ``varies`` gives
    it true (False where the file cannot be read: the search says why)."""
    from .sweep import value_at
    from .yamlio import read_yaml

    key = "simulation.split_replicas"
    if any(k == key and True in values for k, values in varies):
        return True
    try:
        return value_at(read_yaml(Path(path), what="scenario"), key) is True
    except ConfigError:
        return False


def cmd_sweep(args) -> int:
    """Simulate every combination of the ``--vary`` values on the scenario, print the plans
    ranked and, with ``--out``, write sweep.json, sweep.csv (clustersim.sweep) and sweep.html
    (clustersim.output.plans_page)."""
    from .sweep import SWEEP_FILES, format_sweep, parse_vary, run_sweep

    _given_scenario(args.scenario)
    src = "command line"
    if not args.vary:
        raise ConfigError("give what to vary: --vary KEY=V1,V2,... (e.g. --vary parallel.tp=2,4,8), once per key",
                          source=src, field="--vary")
    varies = [parse_vary(v, source=src) for v in args.vary]
    if args.zip:
        lengths = sorted({len(v) for _, v in varies})
        if len(varies) < 2 or len(lengths) > 1:
            said = ", ".join(f"{k} {len(v)}" for k, v in varies)
            raise ConfigError(f"pairs the --vary lists value by value: give two or more, as long as each other "
                              f"(got {said})", source=src, field="--zip")
    n = 1
    for _, values in varies:
        n *= len(values)
    if not args.zip and n > MAX_SWEEP_PLANS:
        raise ConfigError(f"{' x '.join(str(len(v)) for _, v in varies)} = {n:,} plans; a sweep takes at most "
                          f"{MAX_SWEEP_PLANS:,}", source=src, field="--vary")
    return _search(args, varies, SWEEP_FILES, "sweep", 16,
                   lambda jobs, progress: run_sweep(args.scenario, varies, jobs=jobs, progress=progress,
                                                    paired=args.zip, prune=args.skip_unfit), format_sweep)


def _write_gpus_trace(path: Path, result, gpus: list[int]) -> None:
    """trace.json.gz with ``gpus`` as their own processes (``run --trace-gpus``), refused past
    TRACE_GPUS_MAX_SPANS spans."""
    from .output.perfetto import write_trace

    n = result.trace.spans_for_gpus(gpus)  # counted first: the trace of too many would not fit in memory
    if n > TRACE_GPUS_MAX_SPANS:
        raise ConfigError(f"the {len(gpus):,} GPUs named would put {n:,} spans into trace.json.gz, "
                          f"more than {TRACE_GPUS_MAX_SPANS:,} (what Perfetto opens); name fewer",
                          source="command line", field="--trace-gpus")
    from .trace import gpu_ranges

    trace = result.trace.for_gpus(gpus)
    # the file's metadata says what it holds: these GPUs' spans, not the simulated ranks'
    sim = {**result.summary["simulation"], "spans": trace.n_spans, "trace_gpus": gpu_ranges(gpus)}
    write_trace(path, trace, {**result.summary, "simulation": sim})


def _simulated_line(summary: dict, wall_s: float) -> str:
    """The terminal's "simulated" line: ranks, spans, seconds, and what was repeated (and,
    below it, around what the faults reach the classes split, or that the collapse kept it;
    the same of the split where leaf groups cut the plan unevenly; the communications at
    their slowest twin's pace; a slow GPU's replicas in lock-step; collective fallbacks)."""
    from .engine.repeat import ways
    from .output.summary import (asymmetric_note, collective_fallbacks_note, fabric_faults_note, leaf_split_note,
                                 replicas_note, straggler_note, wall_said)

    sim = summary["simulation"]
    rep, tried, m = sim.get("repeat"), sim.get("repeat_tried"), summary["plan"]["microbatches"]
    # (DualPipe's cycle holds as many microbatches of each half: engine.repeat.TWO_WAYS)
    each_way = f" ({rep['cycle_microbatches'] // 2} each way)" if rep and ways(summary["plan"]["schedule"]) == 2 \
        else ""
    cycle = (f" · {rep['simulated_microbatches']} of {m} microbatches run, a cycle of {rep['cycle_microbatches']}"
             f"{each_way} copied in {rep['cycles_copied']} times") if rep else (
        f" · all {m} microbatches run: a shorter step of {tried} showed no steady cycle (--no-repeat skips that try)"
        if tried else "")
    n = sim["simulated_ranks"]
    line = f"{'simulated':<16}{n} rank{'s' if n != 1 else ''}, {sim['spans']:,} spans in {wall_said(wall_s)}{cycle}"
    sep = "\n" + " " * 16
    return (line + replicas_note(sim, sep)
            + fabric_faults_note(sim.get("fabric_faults"), sep, sim["collapse_symmetric"])
            + leaf_split_note(sim.get("leaf_split"), sep, sim["collapse_symmetric"], n)
            + asymmetric_note(sim, sep, summary["world_size"])
            + straggler_note(summary, sep)
            + collective_fallbacks_note(sim.get("collective_fallbacks"), sep))


_SCHEDULE_FLAGS = {"p": "--pp", "m": "--microbatches", "v": "--vpp", "group": "--vpp-group"}


def cmd_schedule(args) -> int:
    from .config import MAX_STAGE_PASSES, read_schedule_file
    from .schedule import CUSTOM, ScheduleError, build_schedule, chunks_per_rank, format_grid
    from .yamlio import given_file

    src = "command line"
    if args.schedule is None:  # a file given is a custom schedule's
        args.schedule = CUSTOM if args.file is not None else "1f1b"
    if args.schedule == CUSTOM:
        if args.file is None:
            raise ConfigError("--schedule custom needs --file FILE (one row of actions per rank)", source=src)
        if args.vpp is not None or args.vpp_group is not None:  # the file gives each rank's stages
            flag = "--vpp" if args.vpp is not None else "--vpp-group"
            raise ConfigError(f"{flag} is used by --schedule interleaved only (schedule is custom: the file gives "
                              "each rank's stages and order)", source=src)
        if args.combined:
            raise ConfigError("--combined pairs the forwards and backwards of 1f1b or interleaved (schedule is custom: "
                              "the file marks its own overlapped chunks with &)", source=src)
        path = given_file(args.file, what="schedule", source=src, field="--file")
        text = read_schedule_file(path, src, "--file")  # as a scenario's: UTF-8, at most 2 MiB
        try:
            sched = build_schedule(CUSTOM, args.pp, args.microbatches, text=text)
        except ScheduleError as exc:
            raise ConfigError(exc.message, source=str(path)) from None
    else:
        if args.file is not None:
            raise ConfigError(f"--file is read by --schedule custom only (schedule is {args.schedule})", source=src)
        if args.pp is None or args.microbatches is None:
            raise ConfigError(f"--schedule {args.schedule} needs --pp and --microbatches", source=src)
        if args.pp < 1 or args.microbatches < 1:
            raise ConfigError("--pp and --microbatches must be >= 1", source=src)
        for flag, given in (("--vpp", args.vpp), ("--vpp-group", args.vpp_group)):
            if given is not None and args.schedule != "interleaved":
                raise ConfigError(f"{flag} is used by --schedule interleaved only (schedule is {args.schedule})",
                                  source=src)
        opts = {"v": args.vpp} if args.vpp is not None and args.schedule == "interleaved" else {}
        if args.vpp_group is not None:
            opts["group"] = args.vpp_group
        if args.combined:
            if args.schedule not in ("1f1b", "interleaved"):
                raise ConfigError(f"--combined pairs the forwards and backwards of 1f1b or interleaved (schedule is "
                                  f"{args.schedule})", source=src)
            if args.schedule == "1f1b" and args.pp > 1:  # (as a scenario's parallel.ep_comm_overlap)
                raise ConfigError(f"--combined: with --pp {args.pp} Megatron-LM combines the interleaved schedule "
                                  f"only (1f1b without a pipeline)", source=src)
            opts["combined"] = True
        v = chunks_per_rank(args.schedule, args.vpp)
        passes = args.pp * args.microbatches * max(v, 1)
        if passes > MAX_STAGE_PASSES:  # as a scenario's (config): the grid is built whole before it is printed
            times = " x --vpp" if args.schedule == "interleaved" else " x 2" if v > 1 else ""
            raise ConfigError(f"--pp x --microbatches{times} = {passes:,} stage passes; "
                              f"clustersim takes at most {MAX_STAGE_PASSES:,}", source=src)
        try:
            sched = build_schedule(args.schedule, args.pp, args.microbatches, **opts)
        except ScheduleError as exc:
            flag = _SCHEDULE_FLAGS.get(exc.about, "--schedule")  # the parameter the refusal is about
            raise ConfigError(exc.message, source=src, field=flag) from None
    print(format_grid(sched))
    return 0


def _ceilings(topo) -> str:
    """"; PCIe at 32 GB/s caps the NICs' 90 GB/s between nodes; ..." for the links of the
    topology ``topo`` that cap its NICs (``link_ceilings``, as ``run`` says them), "" where none
    does: a valid file still, whose transfers between nodes move slower than its NICs."""
    from .hardware.topology import link_ceilings
    from .output.summary import link_ceiling_said

    return "".join(f"; {link_ceiling_said(c)}" for c in link_ceilings(topo) or ())


def _one_leaf(topo) -> str:
    """"; its 2:1 oversubscription is unused: one leaf holds all 16 nodes, fabric.nodes_per_leaf
    being 16: lower it to spread them over leaves" where the topology ``topo`` asks for an oversubscribed fabric over nodes that one
    leaf holds (no spine is built above a single leaf), "" otherwise."""
    from .hardware.topology import network_figures, plan_fabric

    fab = network_figures(topo)["fabric"]
    if not fab or not fab.get("oversubscription_unused"):
        return ""
    given = "" if topo.fabric.nodes_per_leaf is not None else " by default"
    return (f"; its {fab['oversubscription']:g}:1 oversubscription is unused: one leaf holds all {topo.nodes:,} nodes, "
            f"fabric.nodes_per_leaf being {plan_fabric(topo).nodes_per_leaf:,}{given}: lower it to spread them over "
            "leaves")


def cmd_validate(args) -> int:
    """Check every file given, a scenario or a topology, each on a line of its own
    (``error: ...`` on stderr for a bad one, so that a glob's later files are still checked);
    exit 2 if any was bad. A scenario's line gives its memory floor (``api.memory_floor``)
    and says where no run of it can fit ("valid, but cannot fit" instead of "ok"): a valid
    plan still, which ``run`` simulates. With
    ``--set``, each scenario is checked with the changes ``run --set`` would make (a
    topology file is then refused: the changes are a scenario's)."""
    from .api import memory_floor
    from .config import is_topology_data, load_scenario
    from .hardware.gpus import lookup_gpu
    from .hardware.topology import load_topology_cfg
    from .output.summary import GiB, plan_dims
    from .yamlio import read_yaml

    bad = 0
    for path in args.scenarios:
        try:
            _given_scenario(path)
            # (either kind of file: an empty one is not yet either)
            if is_topology_data(read_yaml(Path(path), what="scenario or topology")):
                if args.set:
                    raise ConfigError(f"changes a scenario, and {path} is a topology file (a scenario names it in "
                                      "cluster.topology; --set cluster.node... or cluster.fabric... changes it there)",
                                      source="command line", field="--set")
                topo = load_topology_cfg(Path(path))
                host = topo.node.host  # (whether optimizer offload can run on it)
                print(f"{path}: ok (topology: {topo.nodes} node{'s' if topo.nodes != 1 else ''} x "
                      f"{topo.node.gpus} {lookup_gpu(topo.gpu).name}"  # (the catalogue's name, not an alias)
                      + (f"; host {host.memory_GB:,.0f} GB a node" if host else "; no host for optimizer offload")
                      + _ceilings(topo) + _one_leaf(topo) + ")", flush=True)
                continue
            sc = _with_changes(path, args.set, check_schedule=True)[0] if args.set else load_scenario(path)
        except ConfigError as exc:
            print(f"error: {exc.line()}", file=sys.stderr, flush=True)
            bad += 1
            continue
        n = sc.mesh.world_size
        moe = sc.model.moe
        dims = plan_dims({**sc.parallel.model_dump(), "dispatcher": moe and moe.dispatcher,
                          "shared_expert_overlap": moe and moe.shared_expert_overlap}, " x ")
        floor = memory_floor(sc)  # (milliseconds: what a step must hold, before any task is made)
        need, cap, host = floor["peak_bytes"] / GiB, floor["capacity_bytes"] / GiB, floor["host"]
        hosted = "" if host is None else (f", {host['peak_bytes'] / GiB:,.1f} of {host['capacity_bytes'] / GiB:,.0f} GiB "
                                          "of host memory a node" + ("" if host["fits"] else ", over"))
        # (the line begins "valid, but cannot fit": here, which memory is over, and where)
        gpus = f", over on stage {floor['stage']}" if floor["peak_bytes"] > floor["capacity_bytes"] else ""
        # (a plan no run can fit is still a valid file, exit code 0: "ok" would read as "fits")
        said = "valid, but cannot fit" if gpus or (host is not None and not host["fits"]) else "ok"
        print(f"{sc.source}: {said} ({n} GPU{'s' if n != 1 else ''}, {dims}, "
              f"{sc.microbatches} microbatch{'es' if sc.microbatches != 1 else ''}; memory at least {need:.1f} of "
              f"{cap:.0f} GiB a GPU{gpus}{hosted}{_ceilings(sc.topology)})", flush=True)
    if bad and len(args.scenarios) > 1:
        print(f"error: {bad} of {len(args.scenarios)} files are not valid", file=sys.stderr)
    return EXIT_BAD_INPUT if bad else 0


def cmd_collective(args) -> int:
    from .hardware.topology import load_topology_cfg
    from .netbench import benchmark, format_table, parse_sizes

    sizes = parse_sizes(args.sizes)
    cluster, rows = benchmark(args.topology, args.op, args.gpus, sizes, args.algo)
    print(format_table(cluster, args.op, args.gpus, rows, args.algo, load_topology_cfg(Path(args.topology)).nodes))
    return 0


def cmd_schema(args) -> int:
    from .config import scenario_json_schema
    from .hardware.topology import TopologyCfg

    print(json.dumps(TopologyCfg.model_json_schema() if args.topology else scenario_json_schema(), indent=2))
    return 0


# plans simulated, and seconds, before a search's progress line guesses the time left
ETA_AFTER_PLANS, ETA_AFTER_S = 5, 5.0


def progress_line(done: int, total: int, ran: int, elapsed_s: float) -> str:
    """A search's progress on the terminal: its rows so far of ``total``, and once ``ran``
    plans have been simulated in ``elapsed_s`` (enough of both), the time the rest would take
    at their pace::

        simulated 412 of 1,536 plans, about 5 min left      left = elapsed / ran x (total - done)
    """
    line = f"simulated {done:,} of {total:,} plans"
    left = total - done
    if left <= 0 or ran < ETA_AFTER_PLANS or elapsed_s < ETA_AFTER_S:
        return line
    left_s = elapsed_s / ran * left
    said = (f"{max(left_s, 1):.0f} s" if left_s < 90 else f"{left_s / 60:.0f} min" if left_s < 90 * 60
            else f"{left_s / 3600:.1f} h")
    return f"{line}, about {said} left"


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its errors one line as bad input's are (``error: command line:``,
    the command, argparse's message; exit code 2) and long options written whole (no
    prefixes: ``--all-rank`` is refused, not taken for ``--all-ranks``). An unrecognized
    option is told the command's nearest ones; an unrecognized word, ``hint`` where set
    (:func:`_spaced_change`, set on the top parser with ``words``, the command line)::

        error: command line: run: unrecognized arguments: --output out/x (did you mean --out? python -m clustersim run --help lists the options)
    """

    hint: str | None = None
    words: list[str] | tuple[str, ...] = ()  # (the top parser's: main sets them)
    commands: argparse._SubParsersAction | None = None  # (on the top parser)

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        command = self.prog.split(" ", 1)[1] if " " in self.prog else None
        commands = self.commands.choices if self.commands is not None else {}
        chosen = commands.get(self.words[0]) if self.words else None
        if message.startswith("unrecognized arguments") and chosen is not None:
            command = self.words[0]
            after = self.hint or self._options_hint(command, message.split(": ", 1)[1].split())
        elif message.startswith("argument command: invalid choice") and self.words:
            near = difflib.get_close_matches(self.words[0], list(commands), n=1)
            message = f"{self.words[0]!r} is not a command"
            after = (f"did you mean {near[0]}? " if near else "") + f"the commands: {', '.join(commands)}"
        else:
            after = f"python -m clustersim {command} --help" if command else "python -m clustersim --help"
        said = f"{command}: {message}" if command else message
        self.exit(EXIT_BAD_INPUT, f"error: command line: {said} ({after})\n")

    def _print_message(self, message: str, file=None) -> None:
        """argparse's, but a standard output that cannot take ``--help`` or ``--version`` (``>
        /dev/full``) raises :class:`StreamError`, flushed here so that a buffered one fails too:
        argparse drops the OSError and exits 0 though nothing was written. What goes to stderr
        (a refusal) is dropped where it cannot be written, as :func:`_say` drops it: its exit
        code, 2, says it."""
        if not message:
            return
        file = file or sys.stderr
        try:
            file.write(message)
            file.flush()
        except StreamError as exc:
            if exc.stream == "stdout":
                raise
        except (AttributeError, OSError, ValueError):  # (a stream closed or missing, as argparse allows)
            pass

    def _options_hint(self, command: str, unknown: list[str]) -> str:
        """For options ``command`` does not have: the nearest it has, or the commands that have
        them, then where its options are listed."""
        def options(name: str) -> list[str]:
            return [o for a in self.commands.choices[name]._actions for o in a.option_strings if o.startswith("--")]

        said = []
        for word in (w.split("=", 1)[0] for w in unknown if w.startswith("--")):
            near = difflib.get_close_matches(word, options(command), n=1, cutoff=0.75)
            others = [c for c in self.commands.choices if c != command and word in options(c)]
            if near:
                said.append(f"did you mean {near[0]}?")
            elif others:
                said.append(f"{word} is an option of {' and '.join(others)};")
        return " ".join(said + [f"python -m clustersim {command} --help lists the options"])


# the option of each command that takes KEY=VALUE as one word
CHANGE_OPTIONS = {"run": "--set", "validate": "--set", "compare": "--variant", "sweep": "--vary", "advise": "--vary"}
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.\w+)+")


def _spaced_change(argv: list[str]) -> str | None:
    """How to write ``--vary parallel.tp 4,8`` (a change given as two words, which argparse
    reports only as an unrecognized ``4,8``) as one word, or None where no change is so: the
    command's own option, a dotted key, and a value that is neither an option, an ``=`` nor
    a YAML file (``compare a.yaml --variant parallel.tp b.yaml`` lacks a value instead)."""
    option = CHANGE_OPTIONS.get(argv[0]) if argv else None
    for i, arg in enumerate(argv[:-2]):
        key, value = argv[i + 1], argv[i + 2]
        if (arg == option and _DOTTED.fullmatch(key) and not value.startswith(("-", "="))
                and not value.endswith((".yaml", ".yml"))):
            return f"{option} takes KEY=VALUE as one word: {option} {shlex.quote(f'{key}={value}')}"
    return None


def build_parser() -> argparse.ArgumentParser:
    from .output.summary import ESTIMATE_SPREAD  # (the spread every estimated step is given with)
    from .schedule import SCHEDULE_NAMES

    ap = _Parser(
        prog="clustersim",
        description="Simulate one training step of a transformer on a GPU cluster, event by event.",
        epilog="example: python -m clustersim run scenarios/gpt3_175b_1024gpu.yaml --out out/gpt3")
    from . import __version__

    ap.add_argument("--version", action="version", version=f"clustersim {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    ap.commands = sub

    run = sub.add_parser("run", help="simulate one training step; print a summary, write summary.json, "
                                     "report.html and trace.json.gz")
    run.add_argument("scenario", help="scenario YAML file")
    run.add_argument("--out", help="output folder (default: out/<scenario file name without .yaml>, with --set "
                     "out/<name>+<key>=<value>+...)")
    run.add_argument("--set", action="append", metavar="CHANGES",
                     help="run the scenario with these changes: KEY=VALUE with dotted keys, e.g. --set "
                          "\"parallel.pp=4 parallel.zero=1\" or \"cluster.node.nic.bw_Gbps=800\" (repeatable; "
                          f"{_VALUES_HELP}); the summary's description names them")
    run.add_argument("--no-report", action="store_true", help="skip report.html")
    run.add_argument("--no-trace", action="store_true", help="skip the Perfetto trace")
    run.add_argument("--trace-gpus", metavar="GPUS",
                     help="write these GPUs into trace.json.gz, one process each, e.g. 0-7,517 or all (default: "
                          "one process per simulated rank, labelled with the GPUs it stands for); a GPU's spans "
                          f"are those of the rank that stands for it; at most {TRACE_GPUS_MAX_SPANS:,} spans")
    run.add_argument("--all-ranks", action="store_true",
                     help="simulate every rank instead of one per pipeline stage (slower; identical on "
                          "symmetric placements; otherwise the default's step is an estimate, "
                          f"{ESTIMATE_SPREAD.replace('%', '%%')}: docs/getting-started.md)")
    run.add_argument("--no-repeat", action="store_true",
                     help="simulate every microbatch of a long 1F1B, interleaved, ZB-H1, ZB-V, DualPipeV or "
                          "DualPipe step instead of its steady cycle once (slower; the same spans within a "
                          "nanosecond, or within the rounding a whole step amplifies itself: docs/architecture.md)")
    run.add_argument("--no-check", action="store_true",
                     help="skip the invariant checks run after the simulation (docs/invariants.md)")
    run.set_defaults(func=cmd_run)

    cmp = sub.add_parser("compare", help="simulate several plans and print them side by side: step time, "
                                         "throughput, where a GPU's step goes, memory")
    cmp.add_argument("scenarios", nargs="+", help="scenario YAML files; the first is the baseline")
    cmp.add_argument("--variant", action="append", metavar="CHANGES",
                     help="one more plan: the first file with these changes, KEY=VALUE with dotted keys, e.g. "
                          f"--variant \"parallel.pp=1 parallel.dp=8 parallel.zero=3\" (repeatable; {_VALUES_HELP})")
    cmp.add_argument("--out", help="write compare.json (every plan's summary and differences), compare.html (the "
                                   "plans on one page, their timelines on one time axis) and each plan's report, "
                                   "report_A.html, report_B.html ..., into this folder")
    cmp.add_argument("--no-report", action="store_true", help="with --out, skip compare.html and the plans' reports")
    cmp.set_defaults(func=cmd_compare)

    sw = sub.add_parser("sweep", help="simulate every combination of the values given on one scenario and rank "
                                      "the plans (those that fit by tokens/s)")
    sw.add_argument("scenario", help="scenario YAML file: the model, cluster and batch, and the plan's other settings")
    sw.add_argument("--vary", action="append", metavar="KEY=V1,V2,...",
                    help="a dotted key and its values, e.g. --vary parallel.tp=2,4,8 (repeatable: every combination "
                         "is a plan; each value read as YAML). parallel.dp follows GPUs / (tp x pp x cp) unless "
                         "varied itself; the file's parallel.layers_per_stage gives way to the even split where "
                         "a plan changes pp, vpp or the schedule, unless varied itself")
    sw.add_argument("--jobs", type=int, default=None, help="simulate plans in this many processes (default and at "
                                                           "most: the CPUs; the results do not depend on it)")
    sw.add_argument("--top", type=int, default=20, help="plans printed, best first (default 20)")
    sw.add_argument("--zip", action="store_true",
                    help="pair the --vary lists value by value, one plan per position, instead of every combination "
                         "(e.g. --vary cluster.nodes=4,8,16 --vary training.global_batch_size=64,128,256: weak scaling)")
    sw.add_argument("--skip-unfit", action="store_true",
                    help="list the plans certain not to fit in GPU memory (their weights, gradients, optimizer states "
                         "and the activations their schedule holds exceed it), or in host memory (what they "
                         "offload), without simulating them")
    sw.add_argument("--out", help="write sweep.json, sweep.csv (every plan, refused ones with the rule, those left out "
                                  "with their memory floor) and sweep.html "
                                  "(every plan on one page: tokens/s against memory, the best plans' steps split) into "
                                  "this folder")
    sw.set_defaults(func=cmd_sweep)

    adv = sub.add_parser("advise", help="search the plans around the parallelism guide's options for a scenario's "
                                        "model, cluster and batch; rank them and check the guide's rule")
    adv.add_argument("scenario", help="scenario YAML file: the model, cluster, batch and precision (its plan is a "
                                      "starting point for the settings the search does not vary)")
    adv.add_argument("--vary", action="append", metavar="KEY=V1,V2,...",
                     help="replace a searched dimension's values (e.g. --vary parallel.tp=8) or add one (e.g. "
                          "--vary parallel.schedule=1f1b,interleaved); repeatable; not a key of the model, the "
                          "cluster or the batch (model.*, cluster.*, training.global_batch_size), nor of how the plans "
                          "are simulated (simulation.*: set it in the file): sweep varies those")
    adv.add_argument("--jobs", type=int, default=None, help="simulate plans in this many processes (default and at "
                                                            "most: the CPUs; the results do not depend on it)")
    adv.add_argument("--top", type=int, default=10, help="plans printed, best first (default 10)")
    adv.add_argument("--simulate-unfit", action="store_true",
                     help="simulate the plans certain not to fit in GPU (or host) memory too, for the step they would take "
                          "if they fit (by default they are listed with their memory floor, not simulated)")
    adv.add_argument("--out", help="write advise.json, advise.csv (every plan searched) and advise.html (every plan "
                                   "on one page, the guide's options marked) into this folder")
    adv.set_defaults(func=cmd_advise)

    sch = sub.add_parser("schedule", help="print a pipeline schedule as a step x rank grid")
    sch.add_argument("--pp", type=int, help="pipeline ranks (required, except with --file, which it then checks)")
    sch.add_argument("--microbatches", "-m", type=int,
                     help="microbatches (required, except with --file, which it then checks)")
    sch.add_argument("--schedule", choices=SCHEDULE_NAMES,
                     help="the schedule's name (default 1f1b, or custom when --file is given)")
    sch.add_argument("--vpp", type=int, help="interleaved: model chunks (virtual stages) per rank (default 2)")
    sch.add_argument("--vpp-group", type=int, metavar="G",
                     help="interleaved: microbatches each chunk runs before the next (default --pp; from --pp to "
                          "--microbatches, as Megatron-LM's --microbatch-group-size-per-virtual-pipeline-stage)")
    sch.add_argument("--file", help="a custom schedule, one row of actions per rank (e.g. 0F0 0F1 0B0 ...)")
    sch.add_argument("--combined", action="store_true",
                     help="interleaved, or 1f1b with --pp 1 (as Megatron-LM combines them): combined 1F1B, each "
                          "steady forward with the backward after it as one overlapped chunk "
                          "(parallel.ep_comm_overlap)")
    sch.set_defaults(func=cmd_schedule)

    val = sub.add_parser("validate", help="check scenario (or topology) files without simulating")
    val.add_argument("scenarios", nargs="+",
                     help="scenario or topology YAML files, each checked (exit code 2 if any is bad)")
    val.add_argument("--set", action="append", metavar="CHANGES",
                     help="check each scenario with these changes, as run --set makes them: KEY=VALUE with dotted "
                          f"keys, e.g. --set \"parallel.ep=32\" (repeatable; {_VALUES_HELP})")
    val.set_defaults(func=cmd_validate)

    col = sub.add_parser("collective", help="time one collective on an idle cluster; print algbw and busbw "
                                            "per size (nccl-tests definitions)")
    col.add_argument("--topology", required=True, help="topology YAML file")
    col.add_argument("--op", default="all_reduce",
                     help="all_reduce (default), reduce_scatter, all_gather or all_to_all")
    col.add_argument("--gpus", type=int, default=8, help="GPUs 0..N-1, whole nodes first (default 8)")
    col.add_argument("--sizes", default="1M,16M,1G,8G",
                     help="buffer sizes in binary units (default 1M,16M,1G,8G)")
    col.add_argument("--algo", default="auto", help="auto (default: the fastest applicable), ring, tree, "
                                                    "hierarchical, nvls, nvls_tree, pxn, pairwise")
    col.set_defaults(func=cmd_collective)

    sc = sub.add_parser("schema", help="print the JSON schema of the scenario (or topology) format")
    sc.add_argument("--topology", action="store_true", help="the topology format's schema instead")
    sc.set_defaults(func=cmd_schema)
    return ap


def _sizes_joined(argv: list) -> list:
    """``--sizes -1M`` as ``--sizes=-1M``: argparse takes a value that starts with a dash for an
    option and says only "expected one argument"; joined, the size itself is refused by name."""
    out = []
    for arg in map(str, argv):
        if out and out[-1] == "--sizes" and re.match(r"-[\d.]", arg):
            out[-1] = f"--sizes={arg}"
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None, fast_exit: bool = False) -> int:
    """Run the command ``argv`` (default: the process's arguments); its exit code.

    ``fast_exit`` (``python -m clustersim``, the ``clustersim`` script): the command is the
    whole process, so it ends here with ``os._exit`` once stdout and stderr are flushed. The
    objects the step made (program, trace, engine; a million of each on Megatron-1T) are then
    left to the operating system instead of being freed one by one by reference counting and
    the interpreter's shutdown: 0.35 s on Megatron-1T, about 0.02 s on the MoE step. The files are
    complete by then (written, the writer process waited for, moved into place)."""
    # SIGTERM (kill, timeout, Slurm) stops the command as Ctrl-C does (its temp folder and
    # forked processes gone), rather than end the process where it is
    here = (threading.current_thread() is threading.main_thread()  # (handlers are set there only)
            and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, raise_terminated))  # not where ignored
    before = signal.signal(signal.SIGTERM, raise_terminated) if here else None
    try:
        words = _sizes_joined(sys.argv[1:] if argv is None else list(argv))
        parser = build_parser()
        parser.hint, parser.words = _spaced_change(words), words
        try:
            with _guarded_streams():  # (--help and --version print here: a failing stdout is said as a command's)
                args = parser.parse_args(words)
        except StreamError as exc:
            args, code = None, _unwritable(exc, None)
        if args is not None:
            args.keep = [] if fast_exit else None  # what the command made, held until the exit
            with _guarded_streams():
                code = _run(args)
    except KeyboardInterrupt as exc:  # before the command began (imports, arguments): nothing written
        code = _stopped(exc, None)
    finally:
        if here and not fast_exit:
            signal.signal(signal.SIGTERM, before)
    if here and not fast_exit and code == EXIT_TERMINATED:
        # called in a process of the caller's: its SIGTERM, once the run is cleaned up, does
        # what it would have (the default ends the process), rather than being swallowed
        signal.raise_signal(signal.SIGTERM)
    if fast_exit:
        try:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):  # a closed pipe, or closed after BrokenPipeError
                    pass
        except KeyboardInterrupt as exc:  # the command is done and has said so: only the exit code
            code = code or _stop_code(exc)
        os._exit(code)
    return code


def script() -> int:
    """The ``clustersim`` command (pyproject's script): as ``python -m clustersim``, without
    cyclic garbage collection (see clustersim/__main__.py) and ending by ``os._exit``."""
    import gc

    gc.disable()
    return main(fast_exit=True)


def _run(args) -> int:
    from .analysis.invariants import InvariantError

    try:
        try:
            code = args.func(args)
            sys.stdout.flush()  # (what is left in the buffer: a failure is said here, not lost at the exit)
            return code
        except ConfigError as exc:
            _say(f"error: {exc.line()}")
            return EXIT_BAD_INPUT
        except InvariantError as exc:
            _say(f"error: {exc.report()}\nerror: no outputs written (run with --no-check to skip the checks)")
            return EXIT_INVARIANT
    except BrokenPipeError:  # output piped into head & co.
        sys.stderr.close()
        return 0
    except StreamError as exc:  # stdout or stderr that cannot be written (a full disk): said where it can be
        return _unwritable(exc, getattr(args, "written", None))
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: the temp folder and any forked process are gone already
        return _stopped(exc, getattr(args, "written", None))


def _say(line: str) -> None:
    """Print ``line`` on stderr, where it can be written: a command's last word (bad input,
    a broken invariant) keeps its exit code when stderr is full or closed."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _unwritable(exc: StreamError, written: Path | None) -> int:
    """Say, on stderr where it still can be written, that the command's standard output (or
    error) could not be written (a full disk, ``> /dev/full``), and whether the outputs were in
    ``written`` already; the exit code, bad input's: the output given cannot take the command's
    lines, as an ``--out`` on a full disk cannot take its files."""
    if exc.stream == "stdout":
        done = f"; the outputs are written, in {written}" if written is not None else ""
        _say(f"error: cannot write the standard output: {exc.strerror}{done}")
    return EXIT_BAD_INPUT


def _stop_code(exc: KeyboardInterrupt) -> int:
    """The exit code of a command stopped by Ctrl-C (130) or SIGTERM (:class:`Terminated`, 143)."""
    return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED


def _stopped(exc: KeyboardInterrupt, written: Path | None) -> int:
    """Say that Ctrl-C or SIGTERM stopped the command, and whether the outputs were in
    ``written`` already; the exit code."""
    done = f"the outputs are written, in {written}" if written is not None else "no outputs written"
    try:
        print(f"{'terminated' if isinstance(exc, Terminated) else 'interrupted'}: {done}", file=sys.stderr)
    except (OSError, ValueError):  # stderr closed
        pass
    return _stop_code(exc)
