#!/usr/bin/env python3
"""Runs the gradavg benchmark grid and writes docs/bench_table.md and docs/bench_bandwidth.png.

Usage:
  bench/run_grid.py --binary BUILD/bench/gradavg_bench [--models-binary BUILD/bench/gradavg_bench_models]
                    [--paired-binary BUILD/bench/gradavg_bench_paired] [--paired-rounds N]
                    [--out-dir docs] [--json-dir BUILD/bench] [--quick] [--clock real|cpu]
                    [--filter REGEX] [--models-filter REGEX] [--paired-filter REGEX] [--min-time SECONDS]
  bench/run_grid.py --from-json BUILD/bench/bench_grid.json [--models-json ...] [--paired-json ...]  # no rerun

The table has one row per (op, type, T, P, threads): the bandwidth of gradavg (default options)
(ordinary stores) and gradavg_nt (streaming stores), the faster of the two ("gradavg-best", named), each peer's
time divided by gradavg-best's (above 1: gradavg is faster), gradavg-best's bandwidth as a
fraction of the ordinary-store copy and of the best of copy / copy_nt / memcpy at the same P and
thread count, and for mean_sq the time of gradavg-best's mean_sq over its mean. A summary checks
the targets at P = 16Mi. Bytes are credited STREAM-style (see bench/README.md).

With the paired binary, the targets are first judged on its alternating rounds (every ratio a
median of per-round ratios, so that bandwidth drift between runs cancels), then on the grid.
"""

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys

GRADAVG = ["gradavg", "gradavg_nt"]  # store_policy::regular; store_policy::streaming
PEERS = ["eigen_per_tower", "stacked_tensor", "onednn_sum"]
IMPLS = GRADAVG + PEERS
COPIES = ["copy", "copy_nt", "memcpy"]  # the copy limits; the best of them is "best copy"
LIMITS = COPIES + ["sum"]
MODEL_IMPLS = ["gradavg_vars", "gradavg_flat", "gradavg_nt_vars", "gradavg_nt_flat", "eigen_vars", "eigen_flat"]
MODEL_PAIRS = ["gradavg", "gradavg_nt", "eigen"]  # <name>_vars / <name>_flat
MODEL_COPIES = ["copy", "copy_nt"]
TIME_SCALE = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
DRAM_P = 1 << 24  # the summary's P (16Mi: every working set is far beyond the caches)
# The targets the summary checks at P = DRAM_P, for gradavg-best (the faster of gradavg and
# gradavg_nt): (column, label, threshold, at least (True) or at most (False)).
TARGETS = [
    ("of_copy", "≥0.90 of copy", 0.90, True),
    ("of_best_copy", "≥0.90 of best copy", 0.90, True),
    ("vs_onednn_sum", "≥1.3× onednn_sum", 1.3, True),
    ("vs_eigen_per_tower", "≥2× eigen_per_tower", 2.0, True),
    ("vs_stacked_tensor", "≥4× stacked_tensor", 4.0, True),
    ("sq_over_mean", "mean_sq ≤1.2× mean time", 1.2, False),
]


def paired_counter(col):
    """The paired binary's counter (after "<op>.") for a TARGETS column; its best copy at DRAM
    sizes is copy_nt."""
    return {"of_best_copy": "of.copy_nt", "sq_over_mean": "sq_over_mean"}.get(col, col.replace("_", ".", 1))


# The same targets on the paired binary's counters; sq_over_mean is not per op.
PAIRED_TARGETS = [(paired_counter(col), label, thr, at_least) for col, label, thr, at_least in TARGETS]
MODEL_OVERHEAD_LIMIT = 1.05  # per-variable time / flat time


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", help="the gradavg_bench executable")
    ap.add_argument("--models-binary", help="the gradavg_bench_models executable (optional)")
    ap.add_argument("--from-json", help="skip running: read this grid JSON instead")
    ap.add_argument("--models-json", help="with --from-json: the models JSON (optional)")
    ap.add_argument("--paired-binary", help="the gradavg_bench_paired executable (optional)")
    ap.add_argument("--paired-json", help="with --from-json: the paired JSON (optional)")
    ap.add_argument("--paired-rounds", type=int, default=None,
                    help="alternating rounds per paired point (default: the binary's, 11; quick 3)")
    ap.add_argument("--paired-filter", default=None,
                    help="--benchmark_filter for the paired binary (default: all; quick: P = 64Ki "
                         "and ResNet-50)")
    ap.add_argument("--out-dir", default=str(pathlib.Path(__file__).resolve().parent.parent / "docs"),
                    help="where bench_table.md and bench_bandwidth.png go (default: docs/)")
    ap.add_argument("--json-dir", default=".", help="where the raw JSON results go (default: .)")
    ap.add_argument("--quick", action="store_true",
                    help="short runs (min_time 0.05 s) and ResNet-50 only for the models")
    ap.add_argument("--min-time", type=float, default=None,
                    help="--benchmark_min_time in seconds (default 0.2, quick 0.05)")
    ap.add_argument("--filter", default=None, help="--benchmark_filter for the grid binary")
    ap.add_argument("--repetitions", type=int, default=3,
                    help="runs of each benchmark; the table keeps the fastest "
                         "(STREAM's best-of convention; default 3, quick 1)")
    ap.add_argument("--models-filter", default=None,
                    help="--benchmark_filter for the models binary (default: all; quick: resnet50)")
    ap.add_argument("--clock", choices=["real", "cpu"], default="real",
                    help="time base for bandwidths and ratios (default real; cpu on a busy machine, "
                         "but CPU time is the calling thread's only: wrong for threaded runs)")
    args = ap.parse_args()
    if not args.binary and not args.from_json:
        ap.error("give --binary or --from-json")
    if args.min_time is None:
        args.min_time = 0.05 if args.quick else 0.2
    if args.quick:
        args.repetitions = 1
    if args.models_filter is None and args.quick:
        args.models_filter = "resnet50"
    if args.quick:
        if args.paired_rounds is None:
            args.paired_rounds = 3
        if args.paired_filter is None:
            args.paired_filter = "P:65536|resnet50"
    return args


def run_binary(binary, json_path, min_time, bench_filter, repetitions, extra=()):
    """Runs one benchmark binary; console output goes to the terminal, results to json_path."""
    # Google Benchmark 1.7 takes --benchmark_min_time as seconds (a double, no "s" suffix).
    cmd = [binary, *extra, f"--benchmark_min_time={min_time}", f"--benchmark_out={json_path}",
           "--benchmark_out_format=json", "--benchmark_counters_tabular=false"]
    if repetitions > 1:
        # Consecutive repetitions reuse the tower data; random interleaving would regenerate
        # gigabytes of it for nearly every run.
        cmd.append(f"--benchmark_repetitions={repetitions}")
    if bench_filter:
        cmd.append(f"--benchmark_filter={bench_filter}")
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def parse_name(name):
    """'mean/float/gradavg/T:8/P:65536/threads:1/real_time' -> dict of its fields."""
    parts = [p for p in name.split("/") if p != "real_time"]
    rec = {}
    plain = []
    for p in parts:
        if ":" in p:
            k, v = p.split(":", 1)
            rec[k] = int(v)
        else:
            plain.append(p)
    rec.setdefault("threads", 1)
    if plain[0] == "model":
        rec.update(family="model", model=plain[1], dtype=plain[2], impl=plain[3])
    elif plain[0] == "paired_model":
        rec.update(family="paired_model", model=plain[1], dtype=plain[2], impl="paired")
    elif plain[0] == "paired":
        rec.update(family="paired", dtype=plain[1], impl="paired")
    else:
        rec.update(family=plain[0], dtype=plain[1], impl=plain[2])
    return rec


REPETITIONS_SEEN = 1  # most runs of one benchmark found by load(): what the table reports


def load(json_path, clock):
    """Reads a Google Benchmark JSON file into (context, [records]): one record per benchmark,
    the fastest of its repetitions (aggregates are ignored)."""
    with open(json_path) as f:
        text = f.read()
    if not text.strip():  # Google Benchmark leaves the file empty when the filter matches nothing
        return {}, []
    data = json.loads(text)
    out = []
    for b in data.get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration":
            continue
        rec = parse_name(b["name"])
        if b.get("error_occurred"):
            rec["error"] = b.get("error_message", "error")
            out.append(rec)
            continue
        scale = TIME_SCALE[b.get("time_unit", "ns")]
        real, cpu = b["real_time"] * scale, b["cpu_time"] * scale
        bytes_per_iter = b["bytes_per_second"] * real  # the counter is per real second
        rec["seconds"] = real if clock == "real" else cpu
        rec["bw"] = bytes_per_iter / rec["seconds"]
        out.append(rec)
    fastest, seen = {}, {}
    for rec in out:
        key = tuple(sorted((k, v) for k, v in rec.items() if k not in ("seconds", "bw", "error")))
        seen[key] = seen.get(key, 0) + 1
        best = fastest.get(key)
        if best is None or "error" in rec or ("error" not in best and rec["seconds"] < best["seconds"]):
            fastest[key] = rec
    global REPETITIONS_SEEN
    REPETITIONS_SEEN = max([REPETITIONS_SEEN, *seen.values()])
    return data.get("context", {}), list(fastest.values())


STANDARD_KEYS = {"name", "family_index", "per_family_instance_index", "run_name", "run_type",
                 "repetitions", "repetition_index", "threads", "iterations", "real_time", "cpu_time",
                 "time_unit", "error_occurred", "error_message", "aggregate_name", "aggregate_unit"}


def load_paired(json_path):
    """Reads the paired binary's JSON into [records]: the name's fields, "rounds", and the
    counters under "c" (or "error")."""
    with open(json_path) as f:
        text = f.read()
    if not text.strip():
        return []
    out = []
    for b in json.loads(text).get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration":
            continue
        rec = parse_name(b["name"])
        rec["rounds"] = b.get("iterations")
        if b.get("error_occurred"):
            rec["error"] = b.get("error_message", "error")
        else:
            rec["c"] = {k: v for k, v in b.items() if k not in STANDARD_KEYS and isinstance(v, (int, float))}
        out.append(rec)
    return out


def size_label(p):
    for unit, shift in (("Mi", 20), ("Ki", 10)):
        if p >= (1 << shift) and p % (1 << shift) == 0:
            return f"{p >> shift}{unit}"
    return str(p)


def gbs(bw):
    return f"{bw / 1e9:.1f}"


def machine_line(ctx):
    caches = ", ".join(f"L{c['level']}{c['type'][0].lower() if c['level'] == 1 else ''} "
                       f"{c['size'] // 1024} KiB" for c in ctx.get("caches", []))
    return (f"{ctx.get('num_cpus', '?')} CPUs at {ctx.get('mhz_per_cpu', '?')} MHz; {caches}; "
            f"gradavg {ctx.get('gradavg', '?')}, oneDNN {ctx.get('onednn', '?')}; "
            f"copy_nt stores with {ctx.get('copy_nt_store', '?')}")


class Grid:
    """The grid's records, indexed, and the derived quantities the table and summary share."""

    def __init__(self, recs):
        self.runs = {}    # (dtype, op, T, P, threads, impl) -> record
        self.limits = {}  # (dtype, P, threads, impl) -> record
        self.errors = []
        for r in recs:
            if "error" in r:
                self.errors.append(r)
            elif r["family"] == "limit":
                self.limits[(r["dtype"], r["P"], r["threads"], r["impl"])] = r
            else:
                self.runs[(r["dtype"], r["family"], r["T"], r["P"], r["threads"], r["impl"])] = r
        # (dtype, op, T, P, threads), floats first, mean before mean_sq
        self.keys = sorted({k[:5] for k in self.runs},
                           key=lambda k: (k[0] != "float", k[1] != "mean", k[2], k[3], k[4]))

    def get(self, key, impl):
        return self.runs.get(key + (impl,))

    def best(self, key):
        """(name, record) of the faster of gradavg and gradavg_nt at key, or (None, None)."""
        found = [(self.runs[key + (g,)]["seconds"], g) for g in GRADAVG if key + (g,) in self.runs]
        if not found:
            return None, None
        name = min(found)[1]
        return name, self.runs[key + (name,)]

    def copy(self, dtype, p, threads, impl="copy"):
        return self.limits.get((dtype, p, threads, impl))

    def best_copy(self, dtype, p, threads):
        """(name, record) of the fastest of copy, copy_nt and memcpy, or (None, None)."""
        found = [(r["bw"], c) for c in COPIES if (r := self.limits.get((dtype, p, threads, c)))]
        if not found:
            return None, None
        name = max(found)[1]
        return name, self.limits[(dtype, p, threads, name)]

    def metrics(self, key):
        """Everything a row reports for key = (dtype, op, T, P, threads); absent values are None."""
        dtype, o, t, p, threads = key
        name, best = self.best(key)
        m = {"best": name, "best_rec": best}
        for peer in PEERS:
            pr = self.get(key, peer)
            m["vs_" + peer] = pr["seconds"] / best["seconds"] if (best and pr) else None
        copy = self.copy(dtype, p, threads)
        m["of_copy"] = best["bw"] / copy["bw"] if (best and copy) else None
        bc_name, bc = self.best_copy(dtype, p, threads)
        m["best_copy"] = bc_name
        m["of_best_copy"] = best["bw"] / bc["bw"] if (best and bc) else None
        m["sq_over_mean"] = None
        if o == "mean_sq":
            _, mean_best = self.best((dtype, "mean", t, p, threads))
            if best and mean_best:
                m["sq_over_mean"] = best["seconds"] / mean_best["seconds"]
        return m


def ratio(x):
    return f"{x:.2f}" if x is not None else "-"


def pct(x):
    return f"{x:.0%}" if x is not None else "-"


def verdict(value, threshold, at_least):
    if value is None:
        return "-"
    met = value >= threshold if at_least else value <= threshold
    return f"{value:.2f} {'✓' if met else '✗'}"


def verdict_table(rows, targets):
    """Lines of a targets table and its tallies. rows: (type, op, T, threads, best, values), values
    mapping each target column to a value or None (not measured); targets: (column, label,
    threshold, at least). Ends with how many are met, overall and per thread count."""
    def met(v, thr, at_least):
        return (v >= thr) if at_least else (v <= thr)

    lines = ["| type | op | T | threads | best | " + " | ".join(t[1] for t in targets) + " |",
             "|---|---|---:|---:|---|" + "---:|" * len(targets)]
    for *head, values in rows:
        cells = [verdict(values.get(col), thr, at_least) for col, _, thr, at_least in targets]
        lines.append("| " + " | ".join(str(h) for h in head) + " | " + " | ".join(cells) + " |")

    def tally(subset):
        counts = []
        for col, label, thr, at_least in targets:
            vals = [v for *_, values in subset if (v := values.get(col)) is not None]
            if vals:
                counts.append(f"{label} {sum(met(v, thr, at_least) for v in vals)}/{len(vals)}")
        return "; ".join(counts)

    lines += ["", f"Met: {tally(rows)}."]
    for threads in sorted({r[3] for r in rows}):
        lines.append(f"At {threads} thread{'s' if threads != 1 else ''}: "
                     f"{tally([r for r in rows if r[3] == threads])}.")
    lines.append("")
    return lines


def paired_sections(paired):
    """The table's paired sections (a list of lines); errors are returned separately."""
    points = [r for r in paired if r["family"] == "paired" and "c" in r]
    models = [r for r in paired if r["family"] == "paired_model" and "c" in r]
    rounds = sorted({r["rounds"] for r in paired if r.get("rounds")})
    lines = []
    if not points and not models:
        return lines
    order = lambda r: (r["dtype"] != "float", r["P"], r["threads"], r["T"])
    rounds_text = "/".join(map(str, rounds)) or "?"
    lines += [f"## Targets at P = {size_label(DRAM_P)} (DRAM), paired: median of {rounds_text} alternating rounds",
              "",
              "`gradavg_bench_paired`: each round runs every contender once (copy, copy_nt, gradavg, "
              "gradavg_nt and the peers, mean and mean_sq) in a rotating order; each value is the median "
              "over rounds of that round's ratio, so that the machine's bandwidth drifting between "
              "runs moves both sides of a ratio alike. gradavg-best: the variant (nt or not) with the "
              "lower median time, per op. The best copy is `copy_nt` (non-temporal stores), the "
              "fastest copy at this size.",
              ""]
    dram = sorted((r for r in points if r["P"] == DRAM_P), key=order)
    if dram:
        rows = []
        for r in dram:
            c = r["c"]
            for o in ("mean", "mean_sq"):
                if f"{o}.best_nt" not in c:
                    continue
                values = {col: c.get(f"{o}.{col}") for col, *_ in PAIRED_TARGETS}
                # one counter per point, reported on the mean_sq row
                values["sq_over_mean"] = c.get("sq_over_mean") if o == "mean_sq" else None
                best = "gradavg_nt" if c[f"{o}.best_nt"] else "gradavg"
                rows.append((r["dtype"], o, r["T"], r["threads"], best, values))
        lines += verdict_table(rows, PAIRED_TARGETS)

    if points:
        lines += ["### Paired bandwidths (GB/s, median over rounds) and fractions of the copies", "",
                  "| type | op | T | P | threads | gradavg | gradavg_nt | eigen_per_tower | stacked_tensor | "
                  "onednn_sum | copy | copy_nt | best of copy | best of copy_nt |",
                  "|---|---|---:|---:|---:|" + "---:|" * 9]
        for r in sorted(points, key=order):
            c = r["c"]
            for o in ("mean", "mean_sq"):
                cells = [f"{c[k]:.1f}" if (k := f"GBps.{o}.{i}") in c else "-"
                         for i in ("gradavg", "gradavg_nt", "eigen_per_tower", "stacked_tensor", "onednn_sum")]
                cells += [f"{c[k]:.1f}" if (k := f"GBps.{i}") in c else "-" for i in ("copy", "copy_nt")]
                cells += [pct(c.get(f"{o}.of.copy")), pct(c.get(f"{o}.of.copy_nt"))]
                lines.append(f"| {r['dtype']} | {o} | {r['T']} | {size_label(r['P'])} | {r['threads']} | " +
                             " | ".join(cells) + " |")
        lines.append("")

    if models:
        lines += [f"### Per-variable overhead, paired (mean + squares, float; target ≤{MODEL_OVERHEAD_LIMIT:.2f})", "",
                  "Time with one entry per parameter tensor / time over one flat buffer of the same "
                  "total, median of per-round ratios; the two alternate within every round.", "",
                  "| model | T | threads | gradavg vars/flat | gradavg_nt vars/flat | gradavg flat GB/s | gradavg_nt flat GB/s |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in sorted(models, key=lambda r: (r["model"] != "resnet50", r["model"], r["T"], r["threads"])):
            c = r["c"]
            cells = []
            for i in ("gradavg", "gradavg_nt"):
                v = c.get(f"{i}.vars_over_flat")
                cells.append(f"{v:.3f} ({v - 1:+.1%}) {'✓' if v <= MODEL_OVERHEAD_LIMIT else '✗'}" if v is not None else "-")
            cells += [f"{c[k]:.1f}" if (k := f"GBps.{i}.flat") in c else "-" for i in ("gradavg", "gradavg_nt")]
            lines.append(f"| {r['model']} | {r['T']} | {r['threads']} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def write_table(path, ctx, recs, model_recs, args, paired=()):
    g = Grid(recs)
    threads_all = sorted({k[4] for k in g.keys} | {k[2] for k in g.limits})
    lines = [
        "# gradavg benchmark grid",
        "",
        f"Generated by `bench/run_grid.py{' --quick' if args.quick else ''}` on "
        f"{datetime.date.today().isoformat()}; {args.clock} time, min_time {args.min_time} s, "
        f"best of {REPETITIONS_SEEN} repetition(s), "
        f"threads {', '.join(map(str, threads_all)) or '?'} (1 and all cores).",
        f"Machine: {machine_line(ctx)}.",
        "",
        "Bytes are credited STREAM-style: mean (T+1)·P·sizeof, mean + squares (T+2)·P·sizeof, "
        "copy 2·P·sizeof, read-only sum P·sizeof (see bench/README.md). GB/s = 1e9 bytes/s.",
        "",
        "- `gradavg`: default options (but for threads, the pool and `options.run.stores = "
        "store_policy::regular`); `gradavg_nt`: `store_policy::streaming`. **best** names the faster of the two at that row: "
        "`gradavg-best`.",
        "- `vs <peer>`: peer time / gradavg-best time at the same op, type, T, P and threads "
        "(above 1: gradavg is faster).",
        "- `of copy`: gradavg-best's bandwidth / `copy`'s (Eigen loop, ordinary stores); "
        "`of best copy`: / the fastest of `copy`, `copy_nt` (non-temporal stores) and `memcpy` "
        "(named); both at the same P and thread count.",
        "- `sq/mean`: for mean_sq, gradavg-best's mean_sq time / gradavg-best's mean time at "
        "the same type, T, P and threads.",
        "",
    ]
    if args.clock == "cpu":
        lines += ["**CPU time** of the benchmark's own thread only: rows with more than one thread "
                  "leave the other threads' work out and overstate their bandwidth.", ""]
    lines += paired_sections(paired)
    lines += [
        f"## Targets at P = {size_label(DRAM_P)} (DRAM), from the grid"
        + (" (separate runs: drift between them moves the ratios)" if paired else ""),
        "",
    ]

    dram = [k for k in g.keys if k[3] == DRAM_P]
    if not dram:
        lines += [f"No run at P = {size_label(DRAM_P)} in this data.", ""]
    else:
        lines += ["Each cell: the value for gradavg-best, ✓ when the target is met, ✗ when not, "
                  "- when not measured (oneDNN: float only; sq/mean: mean_sq rows).", ""]
        rows = [(k[0], k[1], k[2], k[4], m["best"] or "-", m) for k in dram for m in [g.metrics(k)]]
        lines += verdict_table(rows, TARGETS)

    lines += ["## Limits (GB/s)", "",
              "| type | P | threads | " + " | ".join(LIMITS) + " | best copy |",
              "|---|---:|---:|" + "---:|" * len(LIMITS) + "---|"]
    for dtype in ("float", "double"):
        for p in sorted({k[1] for k in g.limits if k[0] == dtype}):
            for threads in sorted({k[2] for k in g.limits if k[:2] == (dtype, p)}):
                cells = [gbs(r["bw"]) if (r := g.limits.get((dtype, p, threads, i))) else "-" for i in LIMITS]
                bc = g.best_copy(dtype, p, threads)[0]
                lines.append(f"| {dtype} | {size_label(p)} | {threads} | " + " | ".join(cells) + f" | {bc or '-'} |")

    have_gradavg = any(k[5] in GRADAVG for k in g.runs)
    lines += ["", "## gradavg against its peers", ""]
    if not have_gradavg:
        lines += ["gradavg was not in this run (built with GRADAVG_BENCH_NO_GRADAVG?): "
                  "only the bandwidth table below is filled.", ""]
    lines += ["| type | op | T | P | threads | gradavg GB/s | gradavg_nt GB/s | best | " +
              " | ".join(f"vs {p}" for p in PEERS) + " | of copy | of best copy | sq/mean |",
              "|---|---|---:|---:|---:|---:|---:|---|" + "---:|" * len(PEERS) + "---:|---:|---:|"]
    for k in g.keys:
        m = g.metrics(k)
        cells = [gbs(r["bw"]) if (r := g.get(k, i)) else "-" for i in GRADAVG]
        cells.append(m["best"] or "-")
        cells += [ratio(m["vs_" + peer]) for peer in PEERS]
        cells.append(pct(m["of_copy"]))
        cells.append(f"{pct(m['of_best_copy'])} ({m['best_copy']})" if m["of_best_copy"] is not None else "-")
        cells.append(ratio(m["sq_over_mean"]))
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {size_label(k[3])} | {k[4]} | " + " | ".join(cells) + " |")

    lines += ["", "## Bandwidth of every implementation (GB/s)", "",
              "| type | op | T | P | threads | " + " | ".join(IMPLS + COPIES) + " |",
              "|---|---|---:|---:|---:|" + "---:|" * (len(IMPLS) + len(COPIES))]
    for k in g.keys:
        cells = [gbs(r["bw"]) if (r := g.get(k, i)) else "-" for i in IMPLS]
        cells += [gbs(r["bw"]) if (r := g.copy(k[0], k[3], k[4], c)) else "-" for c in COPIES]
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {size_label(k[3])} | {k[4]} | " + " | ".join(cells) + " |")

    errors = list(g.errors) + [r for r in paired if "error" in r]
    if model_recs:
        models = {}
        mcopy = {}
        for r in model_recs:
            if "error" in r:
                errors.append(r)
            elif r["impl"] in MODEL_COPIES:
                mcopy[(r["model"], r["threads"], r["impl"])] = r
            else:
                models[(r["model"], r["T"], r["threads"], r["impl"])] = r
        lines += ["", "## Model parameter lists: mean + squares, float (GB/s)", "",
                  "`_vars`: one entry per parameter tensor; `_flat`: one buffer of the same total "
                  "size. `<impl> vars/flat`: the time ratio, with the per-variable overhead in "
                  "percent (above 1 / +: the variable list costs time). Threaded eigen splits the "
                  "flat element range as gradavg does. copy, copy_nt: over the flat total; `best vars "
                  "of <copy>`: the faster of gradavg_vars and gradavg_nt_vars, as a fraction of that "
                  "copy's bandwidth." + (" Separate runs: judge vars/flat by the paired table above."
                                          if any(r["family"] == "paired_model" for r in paired) else ""), "",
                  "| model | T | threads | " + " | ".join(MODEL_IMPLS) + " | " +
                  " | ".join(f"{i} vars/flat" for i in MODEL_PAIRS) + " | " + " | ".join(MODEL_COPIES) +
                  " | best vars of copy | best vars of copy_nt |",
                  "|---|---:|---:|" + "---:|" * (len(MODEL_IMPLS) + len(MODEL_PAIRS) + len(MODEL_COPIES) + 2)]
        rows = sorted({k[:3] for k in models}, key=lambda x: (x[0] != "resnet50", x[0], x[1], x[2]))
        for m, t, threads in rows:
            cells = [gbs(r["bw"]) if (r := models.get((m, t, threads, i))) else "-" for i in MODEL_IMPLS]
            for i in MODEL_PAIRS:
                v, fl = models.get((m, t, threads, i + "_vars")), models.get((m, t, threads, i + "_flat"))
                if v and fl:
                    x = v["seconds"] / fl["seconds"]
                    cells.append(f"{x:.2f} ({x - 1:+.0%})")
                else:
                    cells.append("-")
            cells += [gbs(r["bw"]) if (r := mcopy.get((m, threads, c))) else "-" for c in MODEL_COPIES]
            # the faster of gradavg_vars and gradavg_nt_vars, against each copy over the flat total
            best_vars = max((r["bw"] for i in ("gradavg_vars", "gradavg_nt_vars")
                             if (r := models.get((m, t, threads, i)))), default=None)
            for c in MODEL_COPIES:
                r = mcopy.get((m, threads, c))
                cells.append(pct(best_vars / r["bw"]) if (best_vars and r) else "-")
            lines.append(f"| {m} | {t} | {threads} | " + " | ".join(cells) + " |")

    if errors:
        lines += ["", "## Errors", ""]
        for r in errors:
            what = "/".join(str(r.get(k)) for k in ("family", "model", "dtype", "impl", "T", "P", "threads")
                            if k in r)
            lines.append(f"- `{what}`: {r['error']}")

    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


def plot(path, recs):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"warning: no matplotlib in {sys.executable}; {path} not written "
              "(on Debian: apt install python3-matplotlib, run with /usr/bin/python3)", file=sys.stderr)
        return

    g = Grid(recs)
    runs = {k: r["bw"] for k, r in g.runs.items() if k[0] == "float"}
    limits = {k: r["bw"] for k, r in g.limits.items() if k[0] == "float"}
    towers = sorted({k[2] for k in runs})
    threads_all = sorted({k[4] for k in runs})
    ops = [o for o in ("mean", "mean_sq") if any(k[1] == o for k in runs)]
    if not towers:
        print("nothing to plot")
        return
    # One row per (op, thread count), one column per T: each panel has every implementation and
    # the limits at that thread count.
    panels = [(o, n) for o in ops for n in threads_all]
    fig, axes = plt.subplots(len(panels), len(towers), figsize=(3.6 * len(towers), 3.0 * len(panels)),
                             sharex=True, sharey=True, squeeze=False)
    styles = {"gradavg": dict(color="C3", lw=2.2, marker="o"),
              "gradavg_nt": dict(color="C4", lw=2.2, marker="v"),
              "eigen_per_tower": dict(color="C0", marker="s"),
              "stacked_tensor": dict(color="C2", marker="^"),
              "onednn_sum": dict(color="C1", marker="D")}
    limit_styles = {"copy": dict(color="k", ls="--"),
                    "copy_nt": dict(color="0.55", ls="--"),
                    "memcpy": dict(color="C5", ls="--"),
                    "sum": dict(color="k", ls=":")}
    sizes = sorted({k[3] for k in runs})
    for row, (o, n) in enumerate(panels):
        for col, t in enumerate(towers):
            ax = axes[row][col]
            for impl in IMPLS:
                pts = sorted((k[3], v) for k, v in runs.items() if k[1:3] == (o, t) and k[4] == n and k[5] == impl)
                if pts:
                    ax.plot([p for p, _ in pts], [v / 1e9 for _, v in pts], label=impl, **styles[impl])
            for lim in LIMITS:
                pts = sorted((k[1], v) for k, v in limits.items() if k[2] == n and k[3] == lim)
                if pts:
                    ax.plot([p for p, _ in pts], [v / 1e9 for _, v in pts], lw=1, label=f"limit: {lim}",
                            **limit_styles[lim])
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes)
            ax.set_xticklabels([size_label(p) for p in sizes])
            ax.set_title(f"{o}, T={t}, {n} thread{'s' if n != 1 else ''}", fontsize=10)
            ax.grid(True, alpha=0.3)
            if col == 0:
                ax.set_ylabel("GB/s (STREAM-style)")
            if row == len(panels) - 1:
                ax.set_xlabel("elements per tower P (float)")
    handles, labels = [], []
    for ax in axes.flat:  # the union of every panel's lines, in first-seen order
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=9)
    fig.suptitle("Averaging gradients across towers: bandwidth, float (dashed: copy limits, dotted: sum)",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.04 + 0.012 * ((len(labels) + 4) // 5), 1, 0.98))
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main():
    args = parse_args()
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paired_json = None
    if args.from_json:
        grid_json, models_json, paired_json = args.from_json, args.models_json, args.paired_json
    else:
        json_dir = pathlib.Path(args.json_dir)
        json_dir.mkdir(parents=True, exist_ok=True)
        grid_json = str(json_dir / "bench_grid.json")
        run_binary(args.binary, grid_json, args.min_time, args.filter, args.repetitions)
        models_json = None
        if args.models_binary:
            models_json = str(json_dir / "bench_models.json")
            run_binary(args.models_binary, models_json, args.min_time, args.models_filter, args.repetitions)
        if args.paired_binary:
            # Rounds are fixed iterations: min_time does not apply, and repetitions are not needed.
            paired_json = str(json_dir / "bench_paired.json")
            extra = [f"--paired_rounds={args.paired_rounds}"] if args.paired_rounds else []
            run_binary(args.paired_binary, paired_json, args.min_time, args.paired_filter, 1, extra)
    ctx, recs = load(grid_json, args.clock)
    model_recs = load(models_json, args.clock)[1] if models_json and os.path.exists(models_json) else []
    paired = load_paired(paired_json) if paired_json and os.path.exists(paired_json) else []
    write_table(out_dir / "bench_table.md", ctx, recs, model_recs, args, paired)
    plot(out_dir / "bench_bandwidth.png", recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
