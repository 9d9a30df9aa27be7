"""``ftrun report --html FILE``: the report as one self-contained page (no script, no network),
with a timeline drawn as inline SVG: the steps the event log places in time (snapshot
commits, restores, persist targets) over wall time, each fault, its detection, recovery and
restart marked.

Everything comes from the report document (:func:`ftrun.cli.history.report`); every text in it
is escaped.
"""

from __future__ import annotations

from html import escape
from typing import Any

from ftrun.cli import history as hist

WIDTH, HEIGHT = 960, 300
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 16, 40
# Colours of the timeline, one per kind of mark (and its legend entry).
COLORS = {"fault": "#c62828", "detection": "#8e24aa", "recovery": "#ef6c00",
          "restore": "#f9a825", "restored": "#1565c0", "persist": "#2e7d32",
          "commit": "#546e7a"}
# Commit marks drawn at most (evenly chosen): a long job's page stays small.
MAX_COMMIT_MARKS = 2000
STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em; color: #222; max-width: 1000px; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
table { border-collapse: collapse; } td, th { padding: 2px 10px; text-align: left; }
th { border-bottom: 1px solid #999; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
.dim { color: #777; } .bad { color: #c62828; font-weight: bold; } .ok { color: #2e7d32; }
svg text { font: 11px system-ui, sans-serif; }
"""


def _seconds(value: float | None) -> str:
    return hist.NOT_RECORDED if value is None else f"{value:.2f}"


def _svg(doc: dict[str, Any]) -> str:
    """The timeline: x is seconds since the job's start, y the step."""
    h = doc["history"]
    start, wall = h["started_at"], max(doc["time"]["wall_s"], 1e-9)
    commits = h.get("snapshot_commits") or []
    steps = [p["step"] for p in h["restores"] + h["persist_targets"] + commits
             if isinstance(p.get("step"), int)]
    top_step = max(steps + [1])
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(ts: float) -> float:
        return LEFT + plot_w * min(max((ts - start) / wall, 0.0), 1.0)

    def y(step: int) -> float:
        return TOP + plot_h * (1.0 - step / top_step)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="timeline of the job">',
           f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="#fafafa" '
           'stroke="#bbb"/>']
    for i in range(6):  # the time axis
        t = wall * i / 5
        px = LEFT + plot_w * i / 5
        out.append(f'<line x1="{px:.1f}" y1="{TOP + plot_h}" x2="{px:.1f}" '
                   f'y2="{TOP + plot_h + 4}" stroke="#999"/>'
                   f'<text x="{px:.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">'
                   f'{t:.0f} s</text>')
    out.append(f'<text x="{LEFT - 6}" y="{TOP + 4}" text-anchor="end">{top_step}</text>'
               f'<text x="{LEFT - 6}" y="{TOP + plot_h}" text-anchor="end">0</text>'
               f'<text x="12" y="{TOP + plot_h / 2}" transform="rotate(-90 12 '
               f'{TOP + plot_h / 2})" text-anchor="middle">step</text>')
    for f in h["faults"]:
        at = f["at"]
        detect = f["detected_after_s"] or 0.0
        launcher = f["recovery_s"] or 0.0
        back = f["recovered_after_s"]
        bands = [("detection", at, at + detect), ("recovery", at + detect, at + launcher)]
        if back is not None:
            bands.append(("restore", at + launcher, at + back))
        for name, a, b in bands:
            if b > a:
                out.append(f'<rect x="{x(a):.1f}" y="{TOP}" width="{max(x(b) - x(a), 1):.1f}" '
                           f'height="{plot_h}" fill="{COLORS[name]}" fill-opacity="0.25">'
                           f'<title>fault {f["n"]}: {name} {b - a:.2f} s</title></rect>')
        out.append(f'<line x1="{x(at):.1f}" y1="{TOP}" x2="{x(at):.1f}" y2="{TOP + plot_h}" '
                   f'stroke="{COLORS["fault"]}" stroke-width="2"><title>fault {f["n"]}: '
                   f'{escape(f["kind"])}: {escape(f["what"])}</title></line>'
                   f'<text x="{x(at) + 3:.1f}" y="{TOP + 12}" fill="{COLORS["fault"]}">'
                   f'F{f["n"]}</text>')
    stride = max(1, -(-len(commits) // MAX_COMMIT_MARKS))
    for p in commits[::stride]:
        # A short vertical tick, under the other marks: a commit is the common case.
        px, py = x(p["at"]), y(p["step"])
        out.append(f'<line class="commit" x1="{px:.1f}" y1="{py - 4:.1f}" x2="{px:.1f}" '
                   f'y2="{py + 4:.1f}" stroke="{COLORS["commit"]}" stroke-width="1.5">'
                   f'<title>committed step {p["step"]} at +{p["at"] - start:.2f} s</title>'
                   '</line>')
    for p in h["restores"]:
        if isinstance(p.get("step"), int):
            out.append(f'<circle cx="{x(p["at"]):.1f}" cy="{y(p["step"]):.1f}" r="4" '
                       f'fill="{COLORS["restored"]}"><title>restored step {p["step"]} from '
                       f'{escape(str(p.get("source")))}</title></circle>')
    for p in h["persist_targets"]:
        if isinstance(p.get("step"), int):
            px, py = x(p["at"]), y(p["step"])
            out.append(f'<path d="M{px:.1f},{py - 5:.1f} l5,9 h-10 z" fill="{COLORS["persist"]}">'
                       f'<title>persist target: step {p["step"]}</title></path>')
    out.append("</svg>")
    return "".join(out)


def _legend() -> str:
    names = {"fault": "fault", "detection": "detection", "recovery": "recovery (launcher)",
             "restore": "restart of training until the snapshot was restored",
             "restored": "step restored", "persist": "step persisted",
             "commit": "snapshot committed"}
    return " ".join(f'<span style="color:{COLORS[k]}">&#9632;</span> {escape(v)}'
                    for k, v in names.items())


def _placed(h: dict[str, Any]) -> str:
    """What the picture's steps are: where the log places steps in time."""
    count = h.get("snapshots_committed")
    if count is None:
        return ("The log places steps in time only where ranks restored and where a step was "
                "persisted (no snapshot commit recorded); the steps between are not recorded.")
    shown = len(h.get("snapshot_commits") or [])
    marks = min(shown, MAX_COMMIT_MARKS)
    return escape(f"Steps are placed in time where snapshots committed ({count} commit(s)"
                  + (f", {marks} marked" if marks < count else "")
                  + "), where ranks restored and where a step was persisted.")


def render_html(doc: dict[str, Any]) -> str:
    """The report as one HTML page."""
    h, split, proj = doc["history"], doc["time"], doc["projected"]
    run_id = escape(doc["run_id"])
    outcome = h["outcome"]
    rows = []
    for key, name in (("startup_s", "startup (until the ranks first restored)"),
                      ("rendezvous_wait_s", "waiting in rendezvous (outside recoveries)"),
                      ("detection_s", "detection"),
                      *((k, "recovery: " + k[len("recovery_"):-2].replace("_", " "))
                        for k in split if k.startswith("recovery_")),
                      ("restore_s", "restart of training (until the snapshot restored)"),
                      ("snapshot_blocked_s", "blocked by snapshots"),
                      ("recompute_s", "recomputed steps"), ("training_s", "training"),
                      ("wall_s", "wall time")):
        value = split.get(key)
        share = "" if value is None or not split["wall_s"] else \
            f"{100 * value / split['wall_s']:.1f}%"
        rows.append(f"<tr><td>{escape(name)}</td><td class=n>{_seconds(value)}</td>"
                    f"<td class=n>{share}</td></tr>")
    beside = split.get("beside") or {}
    if beside.get("spares"):
        never = beside.get("spares_never_took_over") or 0
        name = (f"spares waiting ({beside['spares']} launcher(s)"
                + (f", {never} never took over" if never else "")
                + "; beside the wall time: the job trained meanwhile)")
        rows.append(f"<tr class=dim><td>{escape(name)}</td>"
                    f"<td class=n>{_seconds(beside.get('spare_wait_s'))}</td><td></td></tr>")
    faults = []
    for f in h["faults"]:
        how = str((f.get("recovery") or {}).get("how") or "-")
        faults.append(
            "<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in (
                f["n"], f["kind"], ",".join(map(str, f["ranks"])) or "-", f.get("host") or "-",
                _seconds(f["detected_after_s"]), _seconds(f["recovered_after_s"]), how,
                "-" if f["resumed_from"] is None else f"{f['resumed_from']} "
                f"({f['restored_from']})",
                hist.NOT_RECORDED if f["steps_lost"] is None else f["steps_lost"],
                f["what"])) + "</tr>")
    ettr = split.get("ettr")
    projected = (f"{proj['ettr']:.3f} projected by {escape(proj['model'])}"
                 if proj.get("ettr") is not None else f"no projection: {escape(proj['why'])}")
    missing = "".join(f"<li>{escape(v)}</li>" for v in doc["missing"].values())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ftrun report: {run_id}</title>
<style>{STYLE}</style></head><body>
<h1>ftrun report: job {run_id}</h1>
<p class="{'ok' if outcome == 'succeeded' else 'bad' if outcome != 'running' else ''}">
{escape(outcome)}{f" (exit code {h['exitcode']})" if h.get('exitcode') is not None else ""},
wall time {split['wall_s']:.1f} s, {len(h['faults'])} fault(s), {h['restarts']} restart(s){
    "" if h.get("snapshots_committed") is None else
    f", {h['snapshots_committed']} snapshot(s) committed"}</p>
<h2>Timeline</h2>
{_svg(doc)}
<p class="dim">{_legend()}<br>{_placed(h)}</p>
<h2>Where the time went</h2>
<table><tr><th>part</th><th>seconds</th><th>share</th></tr>{"".join(rows)}</table>
<p><b>Effective training time ratio:</b> {"not recorded" if ettr is None else f"{ettr:.3f}"}
measured <span class="dim">({escape(split['ettr_note'])})</span>; {projected}.</p>
<h2>Faults</h2>
{"<p>no faults</p>" if not faults else
 "<table><tr><th>#</th><th>kind</th><th>ranks</th><th>host</th><th>detected after (s)</th>"
 "<th>recovered after (s)</th><th>how</th><th>resumed from</th><th>steps lost</th>"
 "<th>what</th></tr>" + "".join(faults) + "</table>"}
<h2>Not recorded in the event log</h2><ul class="dim">{missing}</ul>
</body></html>
"""
