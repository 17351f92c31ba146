#!/usr/bin/env python3
"""Reads gradavg timelines (gradavg::timeline, one Chrome trace file per rank), and merges,
checks and draws them.

  scripts/plot-timeline.py trace.0.json trace.1.json [--merge merged.json] [--png step.png]
      [--check] [--ranks N] [--call K] [--window A,B] [--title TEXT]

--merge  one trace of every rank (Chrome's trace viewer, https://ui.perfetto.dev). Ranks on rank
         0's machine (the files' otherData.host) share its clock and keep their times; a rank on
         another machine is shifted by the median, over the calls, of how much later its
         "agreement" ends than rank 0's: the agreement's collectives release every rank at about
         the same moment.
--check  exits 1 unless every file loads as JSON in the trace event format, every complete event
         has a non-negative duration, the events of each row nest (an event that starts inside
         another ends inside it), the ranks are 0 .. N-1 (--ranks) and each rank's call recorded
         its phases (checks, agreement, fill, sum, unpack, bucket, outcome).
--png    the step drawn with matplotlib (Debian's python3-matplotlib): a row per rank and lane,
         a bar per event, the buckets on the wire under each rank's local pass; --call K draws
         the K-th call across processes (from 0; negative: from the end; default -1, the last),
         from its start on the first rank to its end on the last; --window A,B its milliseconds
         A to B only.
"""
import argparse
import json
import sys

PHASES = ("checks", "agreement", "fill", "sum", "unpack", "bucket", "outcome")


def load(path):
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return trace, events


def complete(events):
    return [e for e in events if e.get("ph") == "X"]


def calls(events):
    """Each call across processes: (begin, end) from its "checks" to its "outcome", in order."""
    starts = sorted(e["ts"] for e in events if e["name"] == "checks" and e["tid"] == 0)
    ends = sorted(e["ts"] + e["dur"] for e in events if e["name"] == "outcome")
    spans = []
    for s in starts:
        later = [t for t in ends if t >= s]
        if later:
            spans.append((s, later[0]))
    return spans


def check(files, ranks):
    problems = []
    seen = set()
    for path, (trace, events) in files.items():
        for e in events:
            if e.get("ph") not in ("X", "M"):
                problems.append(f"{path}: an event of phase {e.get('ph')!r}")
            for key in ("name", "pid"):
                if key not in e:
                    problems.append(f"{path}: an event without {key}: {e}")
        xs = complete(events)
        for e in xs:
            if e["dur"] < 0:
                problems.append(f"{path}: {e['name']} lasts {e['dur']} us")
        rows = {}
        for e in xs:
            rows.setdefault((e["pid"], e["tid"]), []).append(e)
        for (pid, tid), row in rows.items():
            seen.add(pid)
            row.sort(key=lambda e: (e["ts"], -e["dur"]))
            open_ends = []  # the ends of the events enclosing the current one
            for e in row:
                begin, end = e["ts"], e["ts"] + e["dur"]
                while open_ends and open_ends[-1] <= begin:
                    open_ends.pop()
                if open_ends and end > open_ends[-1] + 1e-3:
                    problems.append(f"{path}: rank {pid} row {tid}: {e['name']} at {begin} ends after the event "
                                    f"it starts in")
                open_ends.append(end)
        names = {e["name"] for e in xs}
        for phase in PHASES:
            if phase not in names:
                problems.append(f"{path}: no {phase!r} event")
        if isinstance(trace, dict) and trace.get("otherData", {}).get("dropped", 0):
            problems.append(f"{path}: {trace['otherData']['dropped']} events dropped")
    if ranks is not None and seen != set(range(ranks)):
        problems.append(f"ranks seen {sorted(seen)}, expected 0 .. {ranks - 1}")
    return problems


def merge(files):
    """Every file's events; a rank on another machine than rank 0 (otherData.host) shifted by the
    median, over the calls, of how much later its agreements end than rank 0's."""
    per_rank, hosts = {}, {}
    for trace, events in files.values():
        host = trace.get("otherData", {}).get("host", "") if isinstance(trace, dict) else ""
        for e in events:
            per_rank.setdefault(e["pid"], []).append(dict(e))
            hosts[e["pid"]] = host

    def agreement_ends(events):
        return sorted(e["ts"] + e["dur"] for e in events if e.get("name") == "agreement")

    anchor = agreement_ends(per_rank.get(0, []))
    merged = []
    for pid in sorted(per_rank):
        shift = 0.0
        mine = agreement_ends(per_rank[pid])
        if pid != 0 and (not hosts[pid] or hosts[pid] != hosts.get(0)) and anchor and mine:
            differences = sorted(a - m for a, m in zip(anchor, mine))
            shift = differences[len(differences) // 2]
        for e in per_rank[pid]:
            if "ts" in e:
                e["ts"] += shift
            merged.append(e)
    return merged


def plot(events, png, which, title, window=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = complete(events)
    pids = sorted({e["pid"] for e in xs})
    per_rank = [calls([e for e in xs if e["pid"] == pid]) for pid in pids]
    counts = {len(spans) for spans in per_rank}
    if counts != {len(per_rank[0])} or not per_rank[0]:
        sys.exit(f"plot-timeline: the ranks recorded {sorted(counts)} calls across processes; need the same, at least 1")
    n = len(per_rank[0])
    if not -n <= which < n:
        sys.exit(f"plot-timeline: --call {which}: there are {n} calls")
    # The call on every rank, from the first rank's start to the last one's end.
    lo = min(spans[which][0] for spans in per_rank)
    hi = max(spans[which][1] for spans in per_rank)
    if window is not None:  # milliseconds from the call's start
        lo, hi = lo + window[0] * 1e3, lo + window[1] * 1e3
    colors = {"checks": "#999999", "agreement": "#666666", "fill": "#1f77b4", "sum": "#ff7f0e",
              "unpack": "#2ca02c", "wait": "#d62728", "bucket": "#9467bd", "outcome": "#444444", "pass": "#1f77b4",
              "average bucket": "#bcbd22", "copies": "#17becf", "bucket ready": "#e377c2"}
    rows = sorted({(e["pid"], e["tid"]) for e in xs})
    row_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "thread_name"}
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.5))
    start = lo if window is None else lo - window[0] * 1e3
    for y, (pid, tid) in enumerate(rows):
        # Longest first: an event inside another (a wait in its sum) drawn over it.
        for e in sorted(xs, key=lambda e: -e["dur"]):
            if (e["pid"], e["tid"]) != (pid, tid) or e["ts"] + e["dur"] < lo or e["ts"] > hi:
                continue
            nested = e["name"] in ("wait", "copies")
            ax.broken_barh([((e["ts"] - start) / 1e3, max(e["dur"], 1.0) / 1e3)],
                           (y - (0.2 if nested else 0.4), 0.4 if nested else 0.8),
                           facecolors=colors.get(e["name"], "#bcbd22"), edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {pid} {row_names.get((pid, tid), tid)}" for pid, tid in rows])
    ax.invert_yaxis()
    ax.set_xlim((lo - start) / 1e3, (hi - start) / 1e3)
    ax.set_xlabel("ms from the call's start on the first rank")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for n, c in colors.items() if n != "pass"]
    ax.legend(handles, [n for n in colors if n != "pass"], ncol=8, loc="upper center", bbox_to_anchor=(0.5, -0.18),
              fontsize=8, frameon=False)
    ax.set_title(title or f"gradavg: call {(which if which >= 0 else n + which) + 1} of {n}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--merge")
    parser.add_argument("--png")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--ranks", type=int)
    parser.add_argument("--call", type=int, default=-1)
    parser.add_argument("--title")
    parser.add_argument("--window", help="A,B: only milliseconds A to B of the call")
    args = parser.parse_args()
    files = {path: load(path) for path in args.files}
    status = 0
    if args.check:
        problems = check(files, args.ranks)
        for p in problems:
            print("plot-timeline: " + p, file=sys.stderr)
        status = 1 if problems else 0
        if not problems:
            n = sum(len(complete(events)) for _, events in files.values())
            print(f"plot-timeline: {len(files)} files, {n} events: valid, nested, every rank's phases present")
    merged = merge(files)
    if args.merge:
        with open(args.merge, "w") as f:
            json.dump({"displayTimeUnit": "ms", "traceEvents": merged}, f)
    if args.png:
        window = tuple(float(x) for x in args.window.split(",")) if args.window else None
        plot(merged, args.png, args.call, args.title, window)
    return status


if __name__ == "__main__":
    sys.exit(main())
