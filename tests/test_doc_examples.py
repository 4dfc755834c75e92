"""The commands the README and the docs show, run as a reader runs them, print what they show.

Every fenced block whose first line is a shell prompt (``$ ...``) is a session: each ``$``
line runs in bash, in a folder holding a copy of ``scenarios/`` and ``topologies/``, one
folder per block, and must print the lines below it (stdout and stderr together), where::

    ...                                   any number of lines
    simulated  16 ranks, ... in 1.2 s     any wall time
    $ python -m clustersim run X.yaml     nothing shown: it must run (exit code 0)
    $ # edit the parallel section         a step the reader does by hand: nothing runs
    $ diff A B                            after `$ cp A B`: B is A with the diff shown applied

The README's command (``pip install . && python -m clustersim run scenarios/moe_1024gpu.yaml``,
whose output is the block after it) is run without the install. The Python blocks, and the
commands of the bash blocks, must run without error; a Python block whose output the doc shows
(a paragraph "Output...:" and a plain block after it) must print it. Figures the docs quote in
a table or in prose from a simulation are simulated again here (getting-started's table of
schedules, parallelism.md's context- and expert-parallel figures).

After a deliberate change of what a command prints, ``CLUSTERSIM_UPDATE_DOCS=1 python -m pytest
tests/test_doc_examples.py`` writes what the commands print into the blocks that elide nothing
(a shown wall time is kept); review the diff like code, and the prose around the blocks too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT

FENCE = re.compile(r"^```[a-z]*\n(.*?)^```\n", re.S | re.M)
WALL_S = re.compile(r"(?<= in )\d+(\.\d+)? s\b")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def sessions(text: str) -> list[tuple[str, list[str]]]:
    """A block's (command, the lines it shows) in order."""
    out: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        else:
            out[-1][1].append(line)
    return out


def _blocks() -> list:
    """(doc, block) of every session block, and the README's command with its output block."""
    found = []
    for path in DOCS:
        text = path.read_text()
        fences = list(FENCE.finditer(text))
        for k, m in enumerate(fences):
            body = m.group(1)
            line = text.count("\n", 0, m.start()) + 1
            if body.startswith("$ "):
                found.append(pytest.param(path, body, id=f"{path.name}:{line}"))
            elif path.name == "README.md" and "pip install . && python -m clustersim run" in body and k + 1 < len(fences):
                cmd = body.strip().split(" && ", 1)[1]
                found.append(pytest.param(path, f"$ {cmd}\n{fences[k + 1].group(1)}", id=f"{path.name}:{line}"))
    return found


# a Python block whose output the doc shows: the block, a paragraph that starts so, the output
SHOWN_OUTPUT = re.compile(r"\n\nOutput[^\n]*:\n\n```\n(.*?)^```\n", re.S | re.M)


def _snippets() -> list:
    """The README's and the docs' Python blocks, and the clustersim commands of their bash
    blocks (a reader copies them as they are): each must run without error, and a Python
    block followed by a paragraph "Output...:" and a plain block must print what that block
    shows (``...`` and wall times as in the sessions)."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"^```(python|bash)\n(.*?)^```\n", text, re.S | re.M):
            line = text.count("\n", 0, m.start()) + 1
            if m.group(1) == "python":
                out = SHOWN_OUTPUT.match(text, m.end() - 1)
                found.append(pytest.param("python", (m.group(2), path, None if out is None else out.group(1)),
                                          id=f"{path.name}:{line}"))
                continue
            for cmd in m.group(2).splitlines():
                cmd = cmd.split("  #")[0].strip()
                if cmd.startswith("python -m clustersim"):
                    found.append(pytest.param("bash", cmd, id=f"{path.name}:{line}:{cmd.split()[3]}"))
    return found


def _sandbox(tmp_path: Path) -> dict:
    """A copy of scenarios/ and topologies/ in ``tmp_path``, and the environment to run in."""
    for folder in ("scenarios", "topologies"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(ROOT)}


@pytest.mark.parametrize("kind, code", _snippets())
def test_the_docs_snippets_run(kind, code, tmp_path):
    env = _sandbox(tmp_path)
    code, doc, shown = code if kind == "python" else (code, None, None)
    args = [sys.executable, "-c", code] if kind == "python" else ["bash", "-c", code]
    run = subprocess.run(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:]
    if shown is None:
        return
    got = run.stdout.splitlines()
    if matches(shown.splitlines(), got):
        return
    if os.environ.get("CLUSTERSIM_UPDATE_DOCS") and "..." not in shown.splitlines():
        text = doc.read_text()
        at = text.index(f"```python\n{code}```\n")  # the shown output is the first block after it
        head, tail = text[:at], text[at:]
        doc.write_text(head + tail.replace(f"```\n{shown}```\n", "```\n" + "\n".join(got) + "\n```\n", 1))
    raise AssertionError("--- shown\n" + shown + "--- printed\n" + run.stdout)


def apply_normal_diff(lines: list[str], diff: list[str]) -> list[str]:
    """``lines`` with a normal-format diff (what ``diff A B`` prints: ``16a17,19``, ``2,3c2,3``,
    ``5d4``, with ``<`` and ``>`` lines) applied: B from A."""
    out, at = [], 0  # lines of A copied so far
    i = 0
    while i < len(diff):
        m = re.fullmatch(r"(\d+)(?:,(\d+))?([acd])\d+(?:,\d+)?", diff[i])
        assert m, f"not a diff hunk: {diff[i]!r}"
        first, last, op = int(m.group(1)), int(m.group(2) or m.group(1)), m.group(3)
        i += 1
        keep_to = first if op == "a" else first - 1
        out += lines[at:keep_to]
        at = keep_to if op == "a" else last
        while i < len(diff) and diff[i][:2] in ("< ", "--", "> "):
            if diff[i].startswith("> "):
                out.append(diff[i][2:])
            i += 1
    return out + lines[at:]


def matches(shown: list[str], got: list[str]) -> bool:
    """Whether ``got`` reads as ``shown``: ``...`` stands for any lines, wall times for any."""
    if not shown:
        return not got
    if shown[0].strip() == "...":
        return any(matches(shown[1:], got[k:]) for k in range(len(got) + 1))
    return bool(got) and WALL_S.sub("T s", shown[0]) == WALL_S.sub("T s", got[0]) and matches(shown[1:], got[1:])


@pytest.mark.parametrize("doc, block", _blocks())
def test_the_docs_show_what_the_commands_print(doc, block, tmp_path):
    env = _sandbox(tmp_path)
    update = bool(os.environ.get("CLUSTERSIM_UPDATE_DOCS"))
    wrong, printed = [], []
    for cmd, shown in sessions(block):
        got = []
        if not cmd.startswith("#"):
            diff = re.fullmatch(r"diff (\S+) (\S+)", cmd)
            if diff and shown:
                a, b = (tmp_path / p for p in diff.groups())
                b.write_text("\n".join(apply_normal_diff(a.read_text().splitlines(), shown)) + "\n")
            run = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, timeout=300)
            got = run.stdout.splitlines()
            if not shown:  # (what it prints is not shown: it must run)
                if run.returncode:
                    wrong.append(f"$ {cmd}\n--- exit code {run.returncode}\n" + "\n".join(got))
            elif not matches(shown, got):
                wrong.append(f"$ {cmd}\n--- shown\n" + "\n".join(shown) + "\n--- printed\n" + "\n".join(got))
        keep = not update or not shown or cmd.startswith("#") or any(x.strip() == "..." for x in shown)
        printed += [f"$ {cmd}", *(shown if keep else [x if matches([x], [y]) else y
                                                      for x, y in zip(shown + [""] * len(got), got)])]
    if update and wrong:
        text = doc.read_text()
        new = "\n".join(printed) + "\n"
        old, new = (block, new) if block in text else (block.split("\n", 1)[1], new.split("\n", 1)[1])  # (README)
        doc.write_text(text.replace(old, new, 1))
    assert not wrong, "\n\n".join(wrong)


def test_a_normal_diff_applied_gives_the_file_diff_compares(tmp_path):
    """Changed, added and deleted lines, as `diff` itself prints them."""
    a = ["name: x", "tp: 8", "pp: 4", "dp: 2", "gone", "end"]
    b = ["name: y", "tp: 8", "pp: 4", "extra", "dp: 2", "end", "tail"]
    (tmp_path / "a").write_text("\n".join(a) + "\n")
    (tmp_path / "b").write_text("\n".join(b) + "\n")
    shown = subprocess.run(["diff", "a", "b"], cwd=tmp_path, capture_output=True, text=True).stdout.splitlines()
    assert {re.search("[acd]", h).group() for h in shown if h[0].isdigit()} == {"a", "c", "d"}
    assert apply_normal_diff(a, shown) == b


def test_elided_lines_and_wall_times_match_and_nothing_else_does():
    assert matches(["a", "...", "simulated 2 ranks in 1.0 s"], ["a", "b", "c", "simulated 2 ranks in 13.25 s"])
    assert not matches(["a", "simulated 2 ranks in 1.0 s"], ["a", "simulated 3 ranks in 1.0 s"])
    assert not matches(["a", "b"], ["a", "b", "c"])
    assert matches(["...", "c"], ["a", "b", "c"]) and not matches(["...", "b"], ["a", "b", "c"])


def _schedule_row(name: str) -> str:
    """The getting-started "Compare pipeline schedules" table's row of scenario ``name``,
    simulated now (my_1f1b.yaml: interleaved_1f1b.yaml at 1F1B, as the page's sed makes it)."""
    import yaml

    import clustersim

    src = ROOT / "scenarios" / ("interleaved_1f1b.yaml" if name == "my_1f1b.yaml" else name)
    d = yaml.safe_load(src.read_text())
    if name == "my_1f1b.yaml":
        d["parallel"]["schedule"] = "1f1b"
        d["parallel"].pop("vpp")
    s = clustersim.simulate(clustersim.load_scenario(d, base_dir=src.parent)).summary
    p, x = s["plan"], s["exposed_comm_s"]
    sched = f"`{p['schedule']}`" + (f", vpp {p['vpp']}" if p["schedule"] == "interleaved" else "")
    return (f"| {name} | {sched} | {s['step_time_s']:.4f} s | {100 * s['mfu']:.1f} % | "
            f"{100 * s['bubble_fraction']:.1f} % | {x['total']:.4f} s (tp {x['tp']:.4f}, pp {x['pp']:.4f}, "
            f"dp {x['dp']:.4f}) | {s['memory']['stages'][0]['peak_bytes'] / 2**30:.1f} GiB |")


def test_the_schedules_table_of_getting_started_is_what_they_simulate():
    """The page's table of four schedules holds the figures the scenarios give now (with
    CLUSTERSIM_UPDATE_DOCS set, it is rewritten; then read its prose again)."""
    doc = ROOT / "docs" / "getting-started.md"
    text = doc.read_text()
    rows = re.findall(r"^\| (\S+\.yaml) \|.*\|$", text[text.index("## Compare pipeline schedules"):], re.M)
    assert rows == ["my_1f1b.yaml", "interleaved_1f1b.yaml", "zero_bubble.yaml", "dualpipe.yaml"]
    wrong = []
    for name in rows:
        shown = re.search(rf"^\| {re.escape(name)} \|.*\|$", text, re.M).group(0)
        got = _schedule_row(name)
        if got != shown:
            wrong.append(f"shown:   {shown}\nprinted: {got}")
            text = text.replace(shown, got, 1)
    if wrong and os.environ.get("CLUSTERSIM_UPDATE_DOCS"):
        doc.write_text(text)
    assert not wrong, "\n".join(wrong)


def _variant(name: str, **parallel) -> dict:
    """The summary of shipped scenario ``name`` with ``parallel`` fields changed."""
    import yaml

    import clustersim

    src = ROOT / "scenarios" / name
    d = yaml.safe_load(src.read_text())
    d["parallel"].update(parallel)
    return clustersim.simulate(clustersim.load_scenario(d, base_dir=src.parent)).summary


def _scenario(name: str, parallel=(), training=(), moe=(), model=()):
    """Shipped scenario ``name`` with fields of ``parallel``, ``training``, ``model.moe`` and
    ``model`` changed."""
    import yaml

    import clustersim

    src = ROOT / "scenarios" / name
    d = yaml.safe_load(src.read_text())
    d["parallel"].update(parallel)
    d["training"].update(training)
    d["model"].get("moe", {}).update(moe)
    d["model"].update(model)
    return clustersim.load_scenario(d, base_dir=src.parent)


def _quoted_in_parallelism_md(quoted: list[str]) -> None:
    text = " ".join((ROOT / "docs" / "parallelism.md").read_text().split())
    missing = [q for q in quoted if q not in text]
    assert not missing, "docs/parallelism.md should say: " + "; ".join(missing)


def _peak_gib(summary: dict) -> float:
    return summary["memory"]["peak_bytes"] / 2**30


def test_the_figures_parallelism_md_quotes_are_what_the_scenarios_give():
    """docs/parallelism.md's context- and expert-parallel figures, simulated now."""
    import clustersim

    ring = _variant("long_context_cp_128k.yaml")
    gather = _variant("long_context_cp_128k.yaml", cp_comm="all_gather")
    unbalanced = _variant("long_context_cp_128k.yaml", cp_load_balance=False)
    ep16, ep8 = _variant("moe_1024gpu.yaml"), _variant("moe_1024gpu.yaml", ep=8)
    ep32, ep64 = _variant("moe_1024gpu.yaml", ep=32), _variant("moe_1024gpu.yaml", ep=64)
    pp16 = _variant("moe_1024gpu.yaml", pp=16, dp=64, vpp=2)
    plain = _variant("moe_1024gpu.yaml", schedule="1f1b", vpp=1)
    plain_apart = _variant("moe_1024gpu.yaml", schedule="1f1b", vpp=1, overlap_param_gather=False)
    bare = clustersim.simulate(_scenario("moe_1024gpu.yaml", training={"recompute": "none"})).summary
    hot = {"ep_load": [1.5] + [14.5 / 15] * 15}
    skew = clustersim.simulate(_scenario("moe_1024gpu.yaml", moe=hot))
    drop = clustersim.simulate(_scenario("moe_1024gpu.yaml", moe={**hot, "capacity_factor": 1.25})).summary
    pad, pad_even = (clustersim.simulate(_scenario("moe_1024gpu.yaml", moe={**load, "capacity_factor": 1.25,
                                                                            "pad_to_capacity": True})).summary
                     for load in (hot, {}))
    assert pad["step_time_s"] == pytest.approx(pad_even["step_time_s"], rel=1e-9)
    _quoted_in_parallelism_md([
        f"(`cp` exposed {ring['exposed_comm_s']['cp']:.2f} s of a {ring['step_time_s']:.2f} s step)",
        f"exposes {gather['exposed_comm_s']['cp']:.2f} s (step {gather['step_time_s']:.2f} s)",
        f"to {unbalanced['step_time_s']:.2f} s, the difference showing as bubble "
        f"({100 * unbalanced['bubble_fraction']:.0f} % of the step)",
        f"({ep8['step_time_s']:.2f} s against {ep16['step_time_s']:.2f} s)",
        f"peak of {_peak_gib(ep8):.1f} GiB on 80 GB GPUs ({_peak_gib(ep16):.1f} GiB with EP16",
        f"hold less ({_peak_gib(ep32):.1f} and {_peak_gib(ep64):.1f} GiB) and take longer "
        f"({ep32['step_time_s']:.2f} and {ep64['step_time_s']:.2f} s)",
        f"PP8 with four chunks a rank takes {ep16['step_time_s']:.2f} s, PP16 with two {pp16['step_time_s']:.2f} s, "
        f"PP8 under 1F1B {plain['step_time_s']:.2f} s ({plain_apart['step_time_s']:.2f} s without the scenario's "
        f"overlapped gathers", f"without recompute the step would take {bare['step_time_s']:.2f} s but need "
        f"{_peak_gib(bare):.1f} GiB",
        f"the step goes from {ep16['step_time_s']:.2f} s to {skew.summary['step_time_s']:.2f} s "
        f"(+{100 * (skew.summary['step_time_s'] / ep16['step_time_s'] - 1):.0f} %), MFU from "
        f"{100 * ep16['mfu']:.1f} % to {100 * skew.summary['mfu']:.1f} %, with "
        f"{skew.summary['exposed_comm_s']['ep']:.2f} s of exposed EP time; the run keeps one rank per (stage, EP "
        f"index), {len(skew.trace.ranks)} of 1024",
        f"the step takes {drop['step_time_s']:.2f} s, MFU {100 * drop['mfu']:.1f} %",
        f"carries, 1.25 shares: {pad['step_time_s']:.2f} s, as under balanced routing",
    ])
    assert not ep8["memory"]["fits"] and ep16["memory"]["fits"] and not bare["memory"]["fits"]


def _ulysses_and_combined_figures() -> dict[str, str]:
    """The figures docs/parallelism.md quotes for all-to-all CP and combined 1F1B, formatted
    as it quotes them (placeholder name -> text)."""
    import clustersim

    tp1 = {"tp": 1, "sp": False, "dp": 4, "zero": 1}
    cp = {c: clustersim.simulate(_scenario("long_context_cp_128k.yaml", parallel={**tp1, "cp_comm": c},
                                           training={"recompute": "full"})).summary
          for c in ("ring", "all_to_all", "all_gather")}
    assert all(s["memory"]["fits"] for s in cp.values())
    sel = {"recompute": "selective"}
    plain, comb = (clustersim.simulate(_scenario("moe_1024gpu.yaml", parallel={"ep_comm_overlap": o},
                                                 training=sel)).summary for o in (False, True))
    out = {}
    for key, c in (("RING", "ring"), ("A2A", "all_to_all"), ("AG", "all_gather")):
        out[f"{key}_STEP"] = f"{cp[c]['step_time_s']:.2f}"
        out[f"{key}_CP"] = f"{cp[c]['exposed_comm_s']['cp']:.3f}"
    mha = {"tp": 1, "sp": False, "cp": 16, "dp": 2, "zero": 1}
    for key, c, more in (("HRING", "ring", {}), ("HA2A", "all_to_all", {}), ("HH8", "all_to_all+ring", {"cp_a2a": 8}),
                         ("HH4", "all_to_all+ring", {"cp_a2a": 4})):
        s = clustersim.simulate(_scenario("long_context_cp_128k.yaml", parallel={**mha, "cp_comm": c, **more},
                                          training={"recompute": "full"}, model={"kv_heads": 32})).summary
        assert s["memory"]["fits"]
        out[f"{key}_STEP"], out[f"{key}_CP"] = f"{s['step_time_s']:.2f}", f"{s['exposed_comm_s']['cp']:.2f}"
    # the bytes of a layer, a microbatch, at TP1 x CP8: all-to-all's 2 QKV + 3 C, the ring's 3 (c - 1) KV
    m, c = _scenario("long_context_cp_128k.yaml").model, 8
    tok = m.seq_len / c
    qkv, ctx, kv = (2 * tok * (m.heads + 2 * m.n_kv_heads) * m.head_dim, 2 * tok * m.heads * m.head_dim,
                    2 * tok * 2 * m.n_kv_heads * m.head_dim)
    out["A2A_GB"], out["RING_GB"] = f"{(2 * qkv + 3 * ctx) / 1e9:.2f}", f"{3 * (c - 1) * kv / 1e9:.2f}"
    for key, s in (("PLAIN", plain), ("COMB", comb)):
        out[f"{key}_STEP"] = f"{s['step_time_s']:.2f}"
        out[f"{key}_EP"] = f"{s['exposed_comm_s']['ep']:.2f}"
        out[f"{key}_GIB"] = f"{_peak_gib(s):.1f}"
        assert not s["memory"]["fits"]
    scenario, beside = (clustersim.simulate(_scenario("moe_1024gpu.yaml", moe={"shared_expert_overlap": o})).summary
                        for o in (False, True))
    assert _peak_gib(beside) == _peak_gib(scenario) and beside["memory"]["fits"]
    for key, s in (("SE_PLAIN", scenario), ("SE", beside)):
        out[f"{key}_STEP"], out[f"{key}_EP"] = f"{s['step_time_s']:.2f}", f"{s['exposed_comm_s']['ep']:.2f}"
    return out


ULYSSES_AND_COMBINED = (
    "ring RING_STEP s (`cp` exposed RING_CP s), all-to-all A2A_STEP s (A2A_CP s), all-gather AG_STEP s (AG_CP s)",
    "all-to-alls move `2 QKV + 3 C` = A2A_GB GB a microbatch, `(c-1)/c` of it leaving the rank, where the ring's "
    "shifts move `3(c-1) KV` = RING_GB GB",
    "ring HRING_STEP s (`cp` exposed HRING_CP s), all-to-all over all 16 ranks HA2A_STEP s (HA2A_CP s)",
    "rings across the two nodes: HH8_STEP s (HH8_CP s); with `cp_a2a: 4`, HH4_STEP s.",
    "the step takes PLAIN_STEP s, PLAIN_EP s of it exposed EP all-to-alls; combined, COMB_STEP s and COMB_EP s, "
    "at COMB_GIB GiB a GPU against PLAIN_GIB (one more microbatch in flight)",
    "the step goes from SE_PLAIN_STEP s to SE_STEP s (exposed EP SE_PLAIN_EP s to SE_EP s), at the same memory",
)


def test_the_ulysses_and_combined_1f1b_figures_of_parallelism_md():
    """docs/parallelism.md's all-to-all CP comparison (Llama-3 8B at 128K tokens, TP1 x CP8 x
    DP4) and combined 1F1B on moe_1024gpu's plan with selective recompute, simulated now."""
    figures = _ulysses_and_combined_figures()
    quoted = []
    for q in ULYSSES_AND_COMBINED:
        for k in sorted(figures, key=len, reverse=True):
            q = q.replace(k, figures[k])
        quoted.append(q)
    _quoted_in_parallelism_md(quoted)


def test_the_expert_tensor_parallel_table_of_parallelism_md():
    """docs/parallelism.md's "Expert tensor parallelism" table and prose, simulated now: each
    row's step, exposed EP and TP time and peak, and the nodes an EP group spans."""
    runs = {(ep, etp): _variant("moe_1024gpu.yaml", tp=2, dp=64, sp=True, ep=ep, etp=etp)
            for ep, etp in ((8, 2), (16, 2), (8, 1), (16, 1), (32, 1))}
    text = " ".join((ROOT / "docs" / "parallelism.md").read_text().split())
    for (ep, etp), s in runs.items():
        ex, mem = s["exposed_comm_s"], s["memory"]
        row = (f"| {s['step_time_s']:.2f} s | {ex['ep']:.2f} s | {ex['tp']:.2f} s | {_peak_gib(s):.1f} GiB"
               f"{', tight' if mem['tight'] else ''} |")
        nodes = s["plan"]["ep_nodes"]
        where = "one node" if nodes == 1 else f"{nodes} nodes"
        assert re.search(rf"\| EP{ep}, etp {etp}[^|]*\| [^|]*{where} {re.escape(row)}", text), (ep, etp, row, where)
    tp1 = _variant("moe_1024gpu.yaml")
    best = runs[(8, 1)]
    strided = _variant("moe_1024gpu.yaml", tp=2, dp=64, sp=True, ep=8, etp=1, order="tp-cp-dp-ep-pp")
    _quoted_in_parallelism_md([
        f"TP2 with `etp: 1` and EP8 over DP64 then spans {strided['plan']['ep_nodes']} nodes: "
        f"{strided['step_time_s']:.2f} s on the plan below against {best['step_time_s']:.2f} s",
        f"({runs[(16, 1)]['step_time_s']:.2f} s against {runs[(8, 2)]['step_time_s']:.2f} s, "
        f"{_peak_gib(runs[(16, 1)]):.0f} GiB each)",
        f"takes {best['step_time_s']:.2f} s, {tp1['step_time_s'] / best['step_time_s']:.1f}x faster than the "
        f"scenario's TP1 plan ({tp1['step_time_s']:.2f} s at {_peak_gib(tp1):.1f} GiB), but has "
        f"{best['memory']['margin_bytes'] / 2**30:.1f} GiB of the {best['memory']['capacity_bytes'] / 2**30:.0f} GiB "
        f"the run counts to spare, too little to trust (the run calls a stage tight below "
        f"{best['memory']['tight_below_bytes'] / 2**30:.1f} GiB;",
    ])
    assert best["memory"]["tight"] and not any(r["memory"]["tight"] for k, r in runs.items() if k != (8, 1))


def test_the_deepep_table_of_parallelism_md():
    """docs/parallelism.md's "Deduplicated dispatch" table and prose, simulated now: each EP
    width under NCCL's copies, DeepEP's dedup and DeepSeek-V3's group-limited routing; the
    chances of reaching a node it quotes; and the peaks, which the dispatch leaves alone."""
    import clustersim
    from clustersim.model.moe import token_reach

    runs = {}
    for ep in (8, 16, 32, 64):
        for how, moe in (("alltoall", {"dispatcher": "alltoall"}), ("deepep", {"dispatcher": "deepep"}),
                         ("groups", {"dispatcher": "deepep", "router_groups": 8, "router_group_top_k": 4})):
            runs[(ep, how)] = clustersim.simulate(_scenario("moe_1024gpu.yaml", parallel={"ep": ep}, moe=moe)).summary
    text = " ".join((ROOT / "docs" / "parallelism.md").read_text().split())
    for ep in (8, 16, 32, 64):
        nodes = runs[(ep, "deepep")]["plan"]["ep_nodes"]
        cells = " | ".join(f"{runs[(ep, h)]['step_time_s']:.2f} s ({runs[(ep, h)]['exposed_comm_s']['ep']:.2f} s)"
                           for h in ("alltoall", "deepep", "groups"))
        where = "one node" if nodes == 1 else f"{nodes} nodes"
        assert f"| {ep} | {where} | {cells} |" in text, (ep, cells)
        peaks = [_peak_gib(runs[(ep, h)]) for h in ("alltoall", "deepep", "groups")]
        assert max(peaks) - min(peaks) < 0.15, (ep, peaks)  # (in-flight buffers follow the timing)
    ep16 = runs[(16, "deepep")]
    _quoted_in_parallelism_md([
        f"EP16 over two nodes costs little more than EP8 inside one ({ep16['step_time_s']:.2f} s "
        f"against {runs[(8, 'deepep')]['step_time_s']:.2f} s)",
        f"(`P_N` = {token_reach(256, 8, 1, 1, tuple(range(128))):.3f})",
        f"fits at {_peak_gib(ep16):.1f} GiB and would take {ep16['step_time_s']:.2f} s rather than "
        f"{runs[(16, 'alltoall')]['step_time_s']:.2f} s",
        f"(`P_N` = {token_reach(256, 8, 8, 4, tuple(range(32))):.2f} a node against "
        f"{token_reach(256, 8, 1, 1, tuple(range(32))):.2f}), {runs[(64, 'groups')]['step_time_s']:.2f} s against "
        f"{runs[(64, 'deepep')]['step_time_s']:.2f} s",
    ])
    assert ep16["memory"]["fits"]
    comment = " ".join(line.lstrip("# ") for line in (ROOT / "scenarios/moe_1024gpu.yaml").read_text().splitlines()
                       if line.startswith("#"))
    assert f"as DeepSeek-V3's DeepEP does: {ep16['step_time_s']:.1f} s)" in comment


def test_the_zero_bubble_figures_of_parallelism_md():
    """docs/parallelism.md's "Zero bubble" figures: what split backwards hold, simulated now."""
    import clustersim
    from clustersim.schedule.core import split_weight_passes

    ep16 = _variant("moe_1024gpu.yaml")
    dualpipe = _variant("moe_1024gpu.yaml", schedule="dualpipe", vpp=1)
    dualpipe_apart = _variant("moe_1024gpu.yaml", schedule="dualpipe", vpp=1, overlap_param_gather=False)
    zb = _variant("moe_1024gpu.yaml", schedule="zb-h1", vpp=1)
    bare = clustersim.simulate(_scenario("moe_1024gpu.yaml", {"schedule": "dualpipe", "vpp": 1},
                                         {"recompute": "none"})).summary
    low = clustersim.api.lower_step(_scenario("moe_1024gpu.yaml", {"schedule": "dualpipe", "vpp": 1}))[1]
    middle = low.mesh.pp // 2 - 1
    split, held, most = split_weight_passes(low.schedule, middle), set(), 0
    for a in low.schedule.actions[middle]:  # split backwards whose B has run and W not yet, most at once
        if (a.stage, a.mb) in split and a.kind != "F":
            held ^= {(a.stage, a.mb)}  # in at its B, out at its W
            most = max(most, len(held))
    last = [a for a in low.schedule.actions[middle] if a.kind == "B"][-most:]
    assert all((a.stage, a.mb) in split for a in last)
    per_part = max(low.work[j].wgrad_bytes_per_mb for j in low.parts_of[middle])
    moe_none = clustersim.api.lower_step(_scenario("moe_1024gpu.yaml", training={"recompute": "none"}))[1].work[2]
    ratio = [w.wgrad_bytes_per_mb / w.activation_bytes_per_mb for w in (
        clustersim.api.lower_step(_scenario("zero_bubble.yaml", training={"recompute": "full"}))[1].work[1],
        low.work[2])]
    seqsel = clustersim.api.lower_step(_scenario("korthikanti_22b_seqsel.yaml"))[1].work[0]
    zb_yaml = _variant("zero_bubble.yaml")["memory"]["stages"]
    _quoted_in_parallelism_md([
        f"takes {dualpipe['step_time_s']:.2f} s against the interleaved plan's {ep16['step_time_s']:.2f} s "
        f"({dualpipe_apart['step_time_s']:.2f} s without the overlapped gathers;",
        f"hold back the `W`s of their last {most} backwards, all {most} at once at the end of the step, "
        f"each holding {per_part / 2**30:.1f} GiB",
        f"for a peak of {_peak_gib(dualpipe):.1f} GiB on 80 GB GPUs; ZB-H1 peaks at {_peak_gib(zb):.1f} GiB "
        "on its last stage",
        f"Without recompute DualPipe would need {_peak_gib(bare):.1f} GiB.",
        f"`B` recomputed: {ratio[0]:.0f} times the checkpoint on zero_bubble.yaml's layers, {ratio[1]:.0f} times on",
        f"{seqsel.wgrad_bytes_per_mb / seqsel.activation_bytes_per_mb:.2f} `M_B` on Korthikanti's 22B at TP8",
        f"{moe_none.wgrad_bytes_per_mb / moe_none.activation_bytes_per_mb:.2f} `M_B` on `moe_1024gpu.yaml`'s",
        f"lowers from 12.1 to {zb_yaml[-1]['peak_bytes'] / 2**30:.1f} GiB",
    ])
    assert max(zb["memory"]["stages"], key=lambda st: st["peak_bytes"])["stage"] == zb["plan"]["pp"] - 1
    assert not dualpipe["memory"]["fits"] and max(range(low.mesh.pp), key=lambda q: len(
        split_weight_passes(low.schedule, q))) != middle  # the most held at once, not the most split


def test_the_dualpipev_figures_of_parallelism_md():
    """docs/parallelism.md's DualPipeV paragraph: steps and peaks on moe_1024gpu's model at PP8
    and PP16, the rank-by-rank rise of the peaks and the W's each rank holds back at once."""
    import clustersim
    from clustersim.schedule.core import split_weight_passes

    dualpipe = _variant("moe_1024gpu.yaml", schedule="dualpipe", vpp=1)
    v8 = _variant("moe_1024gpu.yaml", schedule="dualpipev", vpp=1)
    v16 = _variant("moe_1024gpu.yaml", schedule="dualpipev", vpp=1, pp=16, dp=64)
    peaks = [st["peak_bytes"] / 2**30 for st in v8["memory"]["stages"]]
    _quoted_in_parallelism_md([
        f"On the same plan its bubble is {100 * v8['bubble_fraction']:.1f} % of the step, against "
        f"{100 * _variant('moe_1024gpu.yaml')['bubble_fraction']:.1f} % interleaved, and it takes "
        f"{v8['step_time_s']:.2f} s with a peak of {_peak_gib(v8):.1f} GiB, "
        f"{_peak_gib(dualpipe) - _peak_gib(v8):.0f} GiB less than DualPipe's, and at PP16 x DP64 "
        f"{v16['step_time_s']:.2f} s and {_peak_gib(v16):.1f} GiB",
        f"from {peaks[0]:.1f} GiB on rank 0 to {peaks[-1]:.1f} GiB on rank {len(peaks) - 1}",
    ])
    assert peaks == sorted(peaks) and not v16["memory"]["fits"]
    assert min(v8["step_time_s"], v16["step_time_s"]) > _variant("moe_1024gpu.yaml")["step_time_s"]
    sched = clustersim.api.lower_step(_scenario("moe_1024gpu.yaml", {"schedule": "dualpipev", "vpp": 1}))[1].schedule
    for r in range(sched.ranks):  # the W's held back at once: in at a split B, out at its W
        split, held, most = split_weight_passes(sched, r), set(), 0
        for a in sched.actions[r]:
            if (a.stage, a.mb) in split and a.kind != "F":
                held ^= {(a.stage, a.mb)}
                most = max(most, len(held))
        assert most == r + 1


def test_the_recompute_figures_of_parallelism_md():
    """docs/parallelism.md, "Recompute: which layers, which parts": Llama-2 70B in microbatches of 2."""
    import clustersim

    def run(**training):
        return clustersim.simulate(_scenario("llama2_70b_64gpu.yaml", training={"micro_batch_size": 2, **training}),
                                   check=False).summary

    none, full = run(recompute="none"), run(recompute="full")
    block = {n: run(recompute="full", recompute_method="block", recompute_layers=n) for n in (4, 6, 8)}
    uniform = run(recompute="full", recompute_method="uniform", recompute_layers=4)
    groups = {n: run(recompute="full", recompute_method="uniform", recompute_layers=n) for n in (2, 10, 20)} | {
        4: uniform}
    assert not none["memory"]["fits"] and not block[4]["memory"]["fits"]
    assert block[6]["memory"]["tight"] and block[8]["memory"]["fits"] and not block[8]["memory"]["tight"]
    last = block[8]["memory"]["stages"][-1]
    _quoted_in_parallelism_md([
        f"no recompute takes {none['step_time_s']:.2f} s but its first stage needs {_peak_gib(none):.1f} GiB of 80",
        f"full recompute fits ({_peak_gib(full):.1f} GiB) and takes {full['step_time_s']:.2f} s",
        f"(`block`, 8) fits at {_peak_gib(block[8]):.1f} GiB in {block[8]['step_time_s']:.2f} s, "
        f"a {100 * (1 - block[8]['step_time_s'] / full['step_time_s']):.0f} % shorter step",
        f"6 layers fit only just ({_peak_gib(block[6]):.1f} GiB, within 5 % of the GPU: `tight`) in "
        f"{block[6]['step_time_s']:.2f} s, 4 do not ({_peak_gib(block[4]):.1f} GiB)",
        f"`uniform` with 4 holds {_peak_gib(uniform):.1f} GiB in {uniform['step_time_s']:.2f} s",
        f"with `block` 8 the last stage peaks at {last['peak_bytes'] / 2**30:.1f} GiB",
        "stage 0 peaks at " + ", ".join(f"{_peak_gib(groups[n]):.1f}" for n in (2, 4, 10)) + f" and "
        f"{_peak_gib(groups[20]):.1f} GiB with groups of 2, 4, 10 and 20, against full's {_peak_gib(full):.1f})",
    ])
    assert all(groups[n]["memory"]["tightest_stage"] == 0 for n in groups)


def test_the_recompute_module_figures_of_parallelism_md():
    """docs/parallelism.md, "Recompute: which layers, which parts": selective recompute by module."""
    import clustersim

    def run(name, **training):
        more = {"micro_batch_size": 2} if name.startswith("llama2") else {}
        return clustersim.simulate(_scenario(name, training={**more, **training}), check=False).summary

    none = run("llama2_70b_64gpu.yaml", recompute="none")
    norms = run("llama2_70b_64gpu.yaml", recompute="selective", recompute_modules=["layernorm"])
    full = run("moe_1024gpu.yaml", recompute="full")
    moe = run("moe_1024gpu.yaml", recompute="selective", recompute_modules=["moe"])
    fits = run("moe_1024gpu.yaml", recompute="selective", recompute_modules=["moe", "layernorm", "mlp"])
    light = run("moe_1024gpu.yaml", recompute="selective", recompute_modules=["moe_act", "layernorm", "shared_experts"])
    assert norms["memory"]["fits"] and not moe["memory"]["fits"] and not light["memory"]["fits"]
    assert fits["memory"]["tight"]
    # what a B holds recomputing, placed while it runs: not at a split backward's last stage's
    # peak, which W's inputs set
    zb = [run("zero_bubble.yaml", recompute="none"),
          run("zero_bubble.yaml", recompute="selective", recompute_modules=["layernorm", "mlp"])]
    last = [r["memory"]["stages"][-1]["peak_bytes"] / 2**30 for r in zb]
    assert last[1] < last[0]
    _quoted_in_parallelism_md([
        f"`zero_bubble.yaml`'s last stage: {last[0]:.2f} GiB without recompute, {last[1]:.2f} with",
        f"`layernorm` alone fits at {_peak_gib(norms):.1f} GiB in {norms['step_time_s']:.2f} s, close to no "
        f"recompute's {none['step_time_s']:.2f} s",
        f"costs nearly what full recompute costs, {moe['step_time_s']:.2f} s against {full['step_time_s']:.2f} s",
        f"and needs {_peak_gib(moe):.1f} GiB; with `layernorm` and `mlp` too it fits only just "
        f"({_peak_gib(fits):.1f} GiB) in {fits['step_time_s']:.2f} s",
        f"take {light['step_time_s']:.2f} s but need {_peak_gib(light):.1f} GiB",
    ])


def test_the_routing_comparison_of_network_md():
    """docs/network.md's advice to compare fabrics under both routings: Llama-2 70B over
    leaves of two nodes without rails, 1:1 and 2:1, hashed and by destination (and, rail
    optimised as shipped, neither moving its step)."""
    import clustersim
    from clustersim.overrides import load_variant

    path = ROOT / "scenarios" / "llama2_70b_64gpu.yaml"
    base = [("cluster.fabric.rail_optimized", False), ("cluster.fabric.nodes_per_leaf", 2)]

    def step(*more: tuple) -> float:
        return clustersim.simulate(load_variant(path, [*base, *more]), check=False, brief=True).summary["step_time_s"]

    hashed = [step(("cluster.fabric.oversubscription", o)) for o in (1, 2)]
    dest = [step(("cluster.fabric.routing", "destination"), ("cluster.fabric.oversubscription", o)) for o in (1, 2)]
    shipped = [clustersim.simulate(load_variant(path, more), check=False, brief=True).summary["step_time_s"]
               for more in ([], [("cluster.fabric.oversubscription", 2)], [("cluster.fabric.routing", "destination")])]
    assert hashed[0] < hashed[1] and dest[0] < dest[1] and dest[0] < hashed[0]
    assert len(set(shipped)) == 1
    text = " ".join((ROOT / "docs" / "network.md").read_text().split())
    said = (f"1:1 and 2:1 take {hashed[0]:.3f} and {hashed[1]:.3f} s hashed, {dest[0]:.3f} and {dest[1]:.3f} s by "
            f"destination (rail-optimised, as shipped, its traffic stays on its rails and neither moves its "
            f"{shipped[0]:.3f} s)")
    assert said in text, said
