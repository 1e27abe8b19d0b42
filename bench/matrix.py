#!/usr/bin/env python3
"""The adaptive data path matrix: mpquic's default transport against each fixed mode (datagram,
datagram + fec auto, reliable) on the kinds of link a site sees within an hour: two unlike paths
bonded, one path with random loss, one path switching between clean and lossy, one path with
jitter, reordering and loss bursts. Each cell is a
scenario in bench/matrix/, run by mpquic-lab with every variant in turn; results go to
bench/results/matrix/CELL/ and the table to bench/results/matrix/summary.md.

    sudo python3 bench/matrix.py                  # every cell, 3 rounds (~1.5 h), then the table
    sudo python3 bench/matrix.py bonding-300-80   # some cells
    sudo python3 bench/matrix.py --rounds 1 loss-60-15
    python3 bench/matrix.py --table               # the table from the results on disk
"""

import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CELLS = os.path.join(ROOT, "bench", "matrix")
OUT = os.path.join(ROOT, "bench", "results", "matrix")
FIXED = ["datagram", "datagram-fec", "reliable"]


def steal_ticks():
    """Ticks the hypervisor took from this VM's vCPUs so far (the `steal` column of /proc/stat)."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def rotated(text, k):
    """The cell's scenario with its `mpquic_variants` list rotated by `k`: each round starts with
    another variant, so a variant does not always run first (after the previous cell) or last.
    (The handover cell gave the default 0.94x of the best per phase when it ran first in both
    rounds, 0.98x when it ran after `reliable`.)"""
    lines = text.splitlines(keepends=True)
    try:
        start = next(i for i, l in enumerate(lines) if l.startswith("mpquic_variants:")) + 1
    except StopIteration:
        return text
    end = start
    while end < len(lines) and lines[end].startswith("  - "):
        end += 1
    items = lines[start:end]
    if not items:
        return text
    k %= len(items)
    return "".join(lines[:start] + items[k:] + items[:k] + lines[end:])


def run(cells, rounds):
    subprocess.run([os.path.join(ROOT, "scripts", "install-deps.sh")], check=True)
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    lab = os.path.join(ROOT, "target", "release", "mpquic-lab")
    for cell in cells:
        shutil.rmtree(os.path.join(OUT, cell), ignore_errors=True)
    # Rounds interleave: every cell's variants once, then again, so a noisy minute on this
    # shared host falls on one round of every variant rather than on all rounds of one.
    for k in range(1, rounds + 1):
        for cell in cells:
            print(f"=== {cell} round {k}/{rounds}", flush=True)
            tmp = tempfile.mkdtemp()
            try:
                with open(os.path.join(CELLS, cell + ".yaml")) as f:
                    scenario = rotated(f.read(), k - 1)
                cell_file = os.path.join(tmp, "cell.yaml")
                with open(cell_file, "w") as f:
                    f.write(scenario)
                stolen = steal_ticks()
                subprocess.run([lab, "run", cell_file, "--out", os.path.join(tmp, "out")], check=True)
                stolen = steal_ticks() - stolen
                out = os.path.join(OUT, cell, f"round-{k}")
                os.makedirs(out)
                for f in ("report.md", "results.json"):
                    shutil.copy(os.path.join(tmp, "out", f), out)
                with open(os.path.join(out, "steal"), "w") as f:
                    f.write(f"{stolen}\n")
                if k < rounds:
                    continue
                # The last round's plots only: they look alike, and they are most of the size.
                for d in glob.glob(os.path.join(tmp, "out", "*", "")):
                    pngs = glob.glob(os.path.join(d, "*.png"))
                    if pngs:
                        dest = os.path.join(OUT, cell, os.path.basename(os.path.dirname(d)))
                        os.makedirs(dest, exist_ok=True)
                        for p in pngs:
                            shutil.copy(p, dest)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)


def load_round(path):
    with open(path) as f:
        d = json.load(f)
    # variant label -> traffic label -> row
    # A variant that failed in this round (its report says why) has no figures to merge.
    return {
        s["system"].removeprefix("mpquic-"): {t["label"]: t for t in s["traffic"]}
        for s in d["systems"]
        if "traffic" in s
    }


def load(cell):
    """The cell's rounds merged: each row's figure is the median over the rounds (per second for
    the intervals), with the lowest and highest beside it (`lo`, `hi`)."""
    rounds = [load_round(p) for p in sorted(glob.glob(os.path.join(OUT, cell, "round-*", "results.json")))]
    merged = {}
    for v, labels in rounds[0].items():
        merged[v] = {}
        for label, row in labels.items():
            rows = [r[v][label] for r in rounds if v in r and label in r[v]]
            mbits = [r.get("mbit", 0) for r in rows]
            m = dict(row)
            if "mbit" not in row:
                # A ping row: the worst round's gap and loss.
                worst = max(rows, key=lambda r: r.get("longest_gap_s", 0))
                m.update(worst, lo=0, hi=0, mbit=0)
                merged[v][label] = m
                continue
            m["mbit"], m["lo"], m["hi"] = statistics.median(mbits), min(mbits), max(mbits)
            ivs = [r.get("intervals_mbit") or [] for r in rows]
            n = min(len(i) for i in ivs)
            m["intervals_mbit"] = [statistics.median(i[j] for i in ivs) for j in range(n)]
            merged[v][label] = m
    return merged, len(rounds)


def steal_line(cell, n):
    ticks = []
    for p in sorted(glob.glob(os.path.join(OUT, cell, "round-*", "steal"))):
        with open(p) as f:
            ticks.append(f.read().strip())
    return f"{n} round(s), medians; ticks stolen by the hypervisor per round: {', '.join(ticks)}"


def spread(rows):
    """The widest spread between rounds of any row of each variant: (hi - lo) / median."""
    out = []
    for v, r in rows.items():
        ws = [(t["hi"] - t["lo"]) / t["mbit"] for t in r.values() if t["mbit"] > 1]
        if ws:
            out.append(f"{v} {max(ws):.0%}")
    return ("widest spread between rounds: " + ", ".join(out)) if out else "ping rows: the worst round"


def ratio(a, b):
    return a / b if b else float("nan")


def best_fixed(rows, label, value):
    return max((value(rows[v][label]), v) for v in FIXED if v in rows)


def bonding_table(cell, rows):
    lines = [f"### {cell}", "",
             "| variant | up 1 | up 16 | down 1 | down 16 | single-path sum up / down |",
             "|---|---|---|---|---|---|"]
    for v, r in rows.items():
        if v not in ["default"] + FIXED:
            continue
        up = r["path 1 alone up 4 streams"]["mbit"] + r["path 2 alone up 4 streams"]["mbit"]
        down = r["path 1 alone down 4 streams"]["mbit"] + r["path 2 alone down 4 streams"]["mbit"]
        cells = []
        for label, s in (("up 1 stream", up), ("up 16 streams", up), ("down 1 stream", down),
                         ("down 16 streams", down)):
            m = r[label]["mbit"]
            cells.append(f"{m:.0f} ({ratio(m, s):.2f})")
        lines.append(f"| {v} | " + " | ".join(cells) + f" | {up:.0f} / {down:.0f} |")
    verdict = []
    for label in ("up 1 stream", "up 16 streams", "down 1 stream", "down 16 streams"):
        best, which = best_fixed(rows, label, lambda t: t["mbit"])
        verdict.append(f"{label} {ratio(rows['default'][label]['mbit'], best):.2f}x ({which})")
    lines += ["", "default / best fixed mode: " + ", ".join(verdict), ""]
    return lines


def ratio_table(cell, rows, columns, base, note):
    """One row per variant, one column per (heading, traffic label): Mbit/s and, in brackets,
    its share of `base(variant, label)` (`note` says of what); then the default against the
    best fixed mode per column."""
    lines = [f"### {cell}", "",
             "| variant | " + " | ".join(h for h, _ in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for v, r in rows.items():
        cells = [f"{r[l]['mbit']:.1f} ({ratio(r[l]['mbit'], base(v, l)):.2f})" for _, l in columns]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    verdict = []
    for h, l in columns:
        best, which = best_fixed(rows, l, lambda t: t["mbit"])
        verdict.append(f"{h} {ratio(rows['default'][l]['mbit'], best):.2f}x ({which})")
    return lines + ["", f"(in brackets: {note})", "",
                    "default / best fixed mode: " + ", ".join(verdict), ""]


def loss_table(cell, rows):
    columns = [(f"{lv} {cc}", f"loss {lv} {cc}") for lv in ("0%", "1%", "10%", "30%")
               for cc in ("cubic", "bbr")]
    return ratio_table(cell, rows, columns,
                       lambda v, l: rows[v][f"loss 0% {l.split()[-1]}"]["mbit"],
                       "share of the same variant's lossless figure with that inner controller")


def jitter_table(cell, rows):
    columns = [(f"{l} {d}", f"{l} {d}") for l in ("jitter 5 ms", "jitter 15 ms reorders",
                                                  "reorder 2%", "bursts 4%") for d in ("up", "down")]
    return ratio_table(cell, rows, columns, lambda v, l: rows["direct"][l]["mbit"],
                       "share of direct TCP on the same link")


def handover_table(cell, rows, phase=20):
    label = "upload 120 s"
    lines = [f"### {cell}", "",
             "| variant | " + " | ".join(f"{i * phase}-{(i + 1) * phase} s" for i in range(6)) + " | whole |",
             "|---|" + "---|" * 7]
    phases = {}
    for v, r in rows.items():
        iv = r[label]["intervals_mbit"]
        phases[v] = [statistics.mean(iv[i * phase:(i + 1) * phase]) for i in range(len(iv) // phase)]
        lines.append(f"| {v} | " + " | ".join(f"{p:.1f}" for p in phases[v]) + f" | {r[label]['mbit']:.1f} |")
    fixed = [v for v in FIXED if v in phases]
    best = sum(max(phases[v][i] for v in fixed) for i in range(len(phases["default"])))
    lines += ["", f"default / best fixed mode per phase, summed: {ratio(sum(phases['default']), best):.2f}x", ""]
    return lines


def blackhole_table(cell, rows):
    faults = ["both ways", "server to client", "client to server"]
    lines = [f"### {cell}", "",
             "Longest ping gap (ms) and pings lost, per fault of the primary (10 ms RTT):", "",
             "| variant | " + " | ".join(faults) + " |",
             "|---|" + "---|" * len(faults)]
    for v, r in rows.items():
        cells = [f"{r[f]['longest_gap_s'] * 1000:.0f} ({r[f]['sent'] - r[f]['received']} lost)" for f in faults]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    worst = max(rows["default"][f]["longest_gap_s"] for f in faults)
    lines += ["", f"default: longest gap of any fault {worst * 1000:.0f} ms (acceptance: <= 100 ms)", ""]
    return lines


def table():
    out = ["# Adaptive data path matrix", "",
           "Mbit/s per variant (in brackets: share of mpquic's own single-path sum, or of the lossless row).",
           "Command: `sudo python3 bench/matrix.py`.", ""]
    cells = sorted({os.path.basename(os.path.dirname(os.path.dirname(p)))
                    for p in glob.glob(os.path.join(OUT, "*", "round-*", "results.json"))})
    for cell in cells:
        rows, n = load(cell)
        if cell.startswith("bonding"):
            out += bonding_table(cell, rows)
        elif cell.startswith("loss"):
            out += loss_table(cell, rows)
        elif cell.startswith("handover"):
            out += handover_table(cell, rows)
        elif cell.startswith("blackhole"):
            out += blackhole_table(cell, rows)
        elif cell.startswith("jitter"):
            out += jitter_table(cell, rows)
        out += [steal_line(cell, n) + "; " + spread(rows), ""]
    text = "\n".join(out)
    with open(os.path.join(OUT, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(text)


def main(argv):
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    rounds = 3
    if "--rounds" in argv:
        i = argv.index("--rounds")
        if i + 1 >= len(argv) or not argv[i + 1].isdigit() or int(argv[i + 1]) < 1:
            sys.exit("matrix.py: --rounds needs a number of rounds >= 1 (see --help)")
        rounds = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    if argv[:1] != ["--table"]:
        known = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(CELLS, "*.yaml")))
        unknown = [c for c in argv if c not in known]
        if unknown:
            sys.exit(f"matrix.py: no such cell: {', '.join(unknown)} (cells: {', '.join(known)}; "
                     "options: --rounds N, --table, --help)")
        run(argv or known, rounds)
    table()


if __name__ == "__main__":
    main(sys.argv[1:])
