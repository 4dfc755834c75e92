"""Shared fixtures: small scenarios built as dicts against the repository's topologies."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SMALL = {
    "name": "small",
    "cluster": {"topology": "topologies/dgx-a100.yaml", "nodes": 2},
    "model": {"name": "tiny", "layers": 4, "hidden": 1024, "heads": 8, "vocab": 32000, "seq_len": 512},
    "parallel": {"tp": 4, "pp": 2, "dp": 2, "schedule": "1f1b"},
    "training": {"micro_batch_size": 1, "global_batch_size": 8},
}


def shipped_scenarios(root: Path = ROOT) -> list[Path]:
    """The scenarios the repository ships, sorted: every ``scenarios/*.yaml`` but a user's own
    ``my_*.yaml`` (docs/getting-started.md writes those next to them, some bad on purpose)."""
    return sorted(p for p in (root / "scenarios").glob("*.yaml") if not p.name.startswith("my_"))


def shipped_topologies(root: Path = ROOT) -> list[Path]:
    """The topologies the repository ships, sorted: every ``topologies/*.yaml`` but a user's
    own ``my_*.yaml`` (docs/getting-started.md suggests copying one under that name)."""
    return sorted(p for p in (root / "topologies").glob("*.yaml") if not p.name.startswith("my_"))


def scenario_dict(**sections) -> dict:
    """SMALL with sections updated key by key, e.g. parallel={"tp": 2}."""
    d = copy.deepcopy(SMALL)
    for k, v in sections.items():
        if isinstance(v, dict) and isinstance(d.get(k), dict):
            d[k].update(v)
        else:
            d[k] = v
    return d


def compressed_alike() -> bool:
    """Whether the trace file's compressor gives the same bytes for the same text every time:
    zlib does; ISA-L's deflate (``perfetto._deflate`` where the ``isal`` package is there)
    need not (the comment there; a CI run saw two runs' files differ). Tests that compare
    trace files made in two processes, or twice, compare their text then (:func:`file_bytes`)."""
    from clustersim.output import perfetto

    return perfetto._deflate.__name__ == "zlib"


def file_bytes(path: Path) -> bytes:
    """A file's bytes to compare with another run's: a ``.gz`` file's text where its compressor
    need not give the same bytes twice (:func:`compressed_alike`; gzip.decompress checks the
    CRC-32 and the length too), else its bytes."""
    import gzip

    data = path.read_bytes()
    return gzip.decompress(data) if path.suffix == ".gz" and not compressed_alike() else data


def files_of(folder: Path) -> dict[str, bytes]:
    """The files of ``folder`` by name, as :func:`file_bytes` gives them."""
    return {p.name: file_bytes(p) for p in sorted(folder.iterdir())}


def bad_corpus(folder: Path) -> tuple[dict[str, str], list[str]]:
    """A corpus of bad files: (file name -> expected message part, the files, sorted)."""
    import yaml

    expected = yaml.safe_load((folder / "expected.yaml").read_text())
    return expected, sorted(p.name for p in folder.glob("*.yaml") if p.name != "expected.yaml")


def assert_refused(err: str, rc: int, named: Path, message: str, out: Path) -> None:
    """``clustersim run`` refused bad input: exit 2, one line naming ``named`` and holding
    ``message``, no traceback, nothing written to ``out``."""
    assert rc == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"error: {named}: ")
    assert message in err
    assert not out.exists()


@pytest.fixture
def root() -> Path:
    return ROOT


@contextlib.contextmanager
def offline_page(path: Path, ready: str, width_px: int = 1400):
    """``path`` open in headless Chromium with nothing beyond file:// reachable, once ``ready``
    (a CSS selector) is drawn: yields (the page, the errors its scripts raised or logged and
    the URLs it tried beyond file://). Skips the test without playwright or the browser."""
    from .test_report import BROWSER_ARGS, CHROMIUM

    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if not CHROMIUM.exists():
        pytest.skip(f"no browser at {CHROMIUM}")
    errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
        try:
            page = browser.new_page(viewport={"width": width_px, "height": 1000})
            page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
            page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file://")
                       else (errors.append(route.request.url), route.abort()))
            page.goto(path.as_uri())
            page.wait_for_selector(ready, timeout=60_000)
            yield page, errors
        finally:
            browser.close()


@pytest.fixture(autouse=True)
def _ctrl_c_left_as_found():
    """Each test leaves Ctrl-C and SIGTERM as it found them, handlers and signal mask: the
    library runs inside a user's process (a notebook, a test), where an ignored or held Ctrl-C
    would outlive the call, and a later test of interrupts would see none."""
    import signal

    def state():
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, []) if hasattr(signal, "pthread_sigmask") else set()
        return (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM),
                {s for s in mask if s in (signal.SIGINT, signal.SIGTERM)})

    before = state()
    yield
    after = state()
    assert after == before, f"Ctrl-C left changed: handlers and held signals {before} -> {after}"
