#!/usr/bin/env python3
"""Runs the gradavg benchmark grid and writes docs/bench_table.md and docs/bench_bandwidth.png.

Usage:
  bench/run_grid.py --binary BUILD/bench/gradavg_bench [--models-binary BUILD/bench/gradavg_bench_models]
                    [--out-dir docs] [--json-dir BUILD/bench] [--quick] [--clock real|cpu]
  bench/run_grid.py --from-json BUILD/bench/bench_grid.json [--models-json ...]   # no rerun

The table reports, for every (type, op, T, P): gradavg's bandwidth, each peer's time divided by
gradavg's (above 1: gradavg is faster), and gradavg's bandwidth as a fraction of the STREAM-style
copy bandwidth at the same P. Bytes are credited STREAM-style (see bench/README.md).
"""

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys

PEERS = ["eigen_per_tower", "stacked_tensor", "onednn_sum"]
IMPLS = ["gradavg"] + PEERS
MODEL_IMPLS = ["gradavg_vars", "gradavg_flat", "eigen_vars", "eigen_flat"]
TIME_SCALE = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", help="the gradavg_bench executable")
    ap.add_argument("--models-binary", help="the gradavg_bench_models executable (optional)")
    ap.add_argument("--from-json", help="skip running: read this grid JSON instead")
    ap.add_argument("--models-json", help="with --from-json: the models JSON (optional)")
    ap.add_argument("--out-dir", default=str(pathlib.Path(__file__).resolve().parent.parent / "docs"),
                    help="where bench_table.md and bench_bandwidth.png go (default: docs/)")
    ap.add_argument("--json-dir", default=".", help="where the raw JSON results go (default: .)")
    ap.add_argument("--quick", action="store_true",
                    help="short runs (min_time 0.05 s) and ResNet-50 only for the models")
    ap.add_argument("--min-time", type=float, default=None,
                    help="--benchmark_min_time in seconds (default 0.2, quick 0.05)")
    ap.add_argument("--filter", default=None, help="--benchmark_filter for the grid binary")
    ap.add_argument("--clock", choices=["real", "cpu"], default="real",
                    help="time base for bandwidths and ratios (default real; cpu on a busy machine)")
    args = ap.parse_args()
    if not args.binary and not args.from_json:
        ap.error("give --binary or --from-json")
    if args.min_time is None:
        args.min_time = 0.05 if args.quick else 0.2
    return args


def run_binary(binary, json_path, min_time, bench_filter):
    """Runs one benchmark binary; console output goes to the terminal, results to json_path."""
    cmd = [binary, f"--benchmark_min_time={min_time}", f"--benchmark_out={json_path}",
           "--benchmark_out_format=json", "--benchmark_counters_tabular=false"]
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
    if plain[0] == "model":
        rec.update(family="model", model=plain[1], dtype=plain[2], impl=plain[3])
    else:
        rec.update(family=plain[0], dtype=plain[1], impl=plain[2])
    return rec


def load(json_path, clock):
    """Reads a Google Benchmark JSON file into (context, [records])."""
    with open(json_path) as f:
        data = json.load(f)
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
    return data.get("context", {}), out


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
            f"gradavg {ctx.get('gradavg', '?')}, oneDNN {ctx.get('onednn', '?')}")


def write_table(path, ctx, recs, model_recs, args):
    grid = {}
    limits = {}
    errors = []
    for r in recs:
        if "error" in r:
            errors.append(r)
            continue
        if r["family"] == "limit":
            limits[(r["dtype"], r["P"], r["impl"])] = r
        else:
            grid[(r["dtype"], r["family"], r["T"], r["P"], r["impl"])] = r

    lines = [
        "# gradavg benchmark grid",
        "",
        f"Generated by `bench/run_grid.py{' --quick' if args.quick else ''}` on "
        f"{datetime.date.today().isoformat()}; {args.clock} time, min_time {args.min_time} s, 1 thread.",
        f"Machine: {machine_line(ctx)}.",
        "",
        "Bytes are credited STREAM-style: mean (T+1)·P·sizeof, mean + squares (T+2)·P·sizeof, "
        "copy 2·P·sizeof, read-only sum P·sizeof (see bench/README.md). GB/s = 1e9 bytes/s.",
        "Ratios are peer time / gradavg time: above 1, gradavg is faster. "
        "\"of copy\" is gradavg's bandwidth over the copy limit's at the same P.",
        "",
        "## Limits (GB/s)",
        "",
        "| type | P | copy | memcpy | sum |",
        "|---|---:|---:|---:|---:|",
    ]
    for dtype in ("float", "double"):
        for p in sorted({k[1] for k in limits if k[0] == dtype}):
            cells = [gbs(limits[(dtype, p, i)]["bw"]) if (dtype, p, i) in limits else "-"
                     for i in ("copy", "memcpy", "sum")]
            lines.append(f"| {dtype} | {size_label(p)} | " + " | ".join(cells) + " |")

    keys = sorted({k[:4] for k in grid},
                  key=lambda k: (k[0] != "float", k[1] != "mean", k[2], k[3]))
    have_gradavg = any(k[4] == "gradavg" for k in grid)
    lines += ["", "## gradavg against its peers", ""]
    if not have_gradavg:
        lines += ["gradavg was not in this run (built with GRADAVG_BENCH_NO_GRADAVG?): "
                  "only the bandwidth table below is filled.", ""]
    lines += ["| type | op | T | P | gradavg GB/s | " + " | ".join(f"vs {p}" for p in PEERS) +
              " | of copy |",
              "|---|---|---:|---:|---:|" + "---:|" * len(PEERS) + "---:|"]
    for k in keys:
        g = grid.get(k + ("gradavg",))
        copy = limits.get((k[0], k[3], "copy"))
        cells = [gbs(g["bw"]) if g else "-"]
        for peer in PEERS:
            pr = grid.get(k + (peer,))
            cells.append(f"{pr['seconds'] / g['seconds']:.2f}" if (g and pr) else "-")
        cells.append(f"{g['bw'] / copy['bw']:.0%}" if (g and copy) else "-")
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {size_label(k[3])} | " + " | ".join(cells) + " |")

    lines += ["", "## Bandwidth of every implementation (GB/s)", "",
              "| type | op | T | P | " + " | ".join(IMPLS) + " | copy |",
              "|---|---|---:|---:|" + "---:|" * (len(IMPLS) + 1)]
    for k in keys:
        cells = [gbs(grid[k + (i,)]["bw"]) if k + (i,) in grid else "-" for i in IMPLS]
        copy = limits.get((k[0], k[3], "copy"))
        cells.append(gbs(copy["bw"]) if copy else "-")
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {size_label(k[3])} | " + " | ".join(cells) + " |")

    if model_recs:
        models = {}
        mcopy = {}
        for r in model_recs:
            if "error" in r:
                errors.append(r)
            elif r["impl"] == "copy":
                mcopy[r["model"]] = r
            else:
                models[(r["model"], r["T"], r["impl"])] = r
        lines += ["", "## Model parameter lists: mean + squares, float (GB/s)", "",
                  "`_vars`: one entry per parameter tensor; `_flat`: one buffer of the same total "
                  "size. vars/flat is the time ratio (above 1: per-variable overhead).", "",
                  "| model | T | " + " | ".join(MODEL_IMPLS) + " | gradavg vars/flat | copy |",
                  "|---|---:|" + "---:|" * (len(MODEL_IMPLS) + 2)]
        for m, t in sorted({(k[0], k[1]) for k in models}, key=lambda x: (x[0] != "resnet50", x[1])):
            cells = [gbs(models[(m, t, i)]["bw"]) if (m, t, i) in models else "-" for i in MODEL_IMPLS]
            v, fl = models.get((m, t, "gradavg_vars")), models.get((m, t, "gradavg_flat"))
            cells.append(f"{v['seconds'] / fl['seconds']:.2f}" if (v and fl) else "-")
            cells.append(gbs(mcopy[m]["bw"]) if m in mcopy else "-")
            lines.append(f"| {m} | {t} | " + " | ".join(cells) + " |")

    if errors:
        lines += ["", "## Errors", ""]
        for r in errors:
            what = "/".join(str(r.get(k)) for k in ("family", "dtype", "impl", "T", "P") if k in r)
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

    grid = {(r["dtype"], r["family"], r["T"], r["P"], r["impl"]): r["bw"]
            for r in recs if "error" not in r and r["family"] != "limit"}
    limits = {(r["dtype"], r["P"], r["impl"]): r["bw"]
              for r in recs if "error" not in r and r["family"] == "limit"}
    towers = sorted({k[2] for k in grid if k[0] == "float"})
    ops = ["mean", "mean_sq"]
    if not towers:
        print("nothing to plot")
        return
    fig, axes = plt.subplots(len(ops), len(towers), figsize=(3.6 * len(towers), 3.4 * len(ops)),
                             sharex=True, sharey=True, squeeze=False)
    styles = {"gradavg": dict(color="C3", lw=2.2, marker="o"),
              "eigen_per_tower": dict(color="C0", marker="s"),
              "stacked_tensor": dict(color="C2", marker="^"),
              "onednn_sum": dict(color="C1", marker="D")}
    for row, o in enumerate(ops):
        for col, t in enumerate(towers):
            ax = axes[row][col]
            for impl in IMPLS:
                pts = sorted((k[3], v) for k, v in grid.items() if k[:3] == ("float", o, t) and k[4] == impl)
                if pts:
                    ax.plot([p for p, _ in pts], [v / 1e9 for _, v in pts], label=impl, **styles[impl])
            for lim, ls in (("copy", "--"), ("sum", ":")):
                pts = sorted((k[1], v) for k, v in limits.items() if k[0] == "float" and k[2] == lim)
                if pts:
                    ax.plot([p for p, _ in pts], [v / 1e9 for _, v in pts], color="k", ls=ls, lw=1,
                            label=f"limit: {lim}")
            ax.set_xscale("log", base=2)
            ax.set_xticks([p for p in sorted({k[3] for k in grid})])
            ax.set_xticklabels([size_label(p) for p in sorted({k[3] for k in grid})])
            ax.set_title(f"{o}, T={t}", fontsize=10)
            ax.grid(True, alpha=0.3)
            if col == 0:
                ax.set_ylabel("GB/s (STREAM-style credit)")
            if row == len(ops) - 1:
                ax.set_xlabel("elements per tower P (float)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9)
    fig.suptitle("Averaging gradients across towers: bandwidth, 1 thread, float", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    args = parse_args()
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        grid_json, models_json = args.from_json, args.models_json
    else:
        json_dir = pathlib.Path(args.json_dir)
        json_dir.mkdir(parents=True, exist_ok=True)
        grid_json = str(json_dir / "bench_grid.json")
        run_binary(args.binary, grid_json, args.min_time, args.filter)
        models_json = None
        if args.models_binary:
            models_json = str(json_dir / "bench_models.json")
            run_binary(args.models_binary, models_json, args.min_time,
                       "resnet50" if args.quick else None)
    ctx, recs = load(grid_json, args.clock)
    model_recs = load(models_json, args.clock)[1] if models_json and os.path.exists(models_json) else []
    write_table(out_dir / "bench_table.md", ctx, recs, model_recs, args)
    plot(out_dir / "bench_bandwidth.png", recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
