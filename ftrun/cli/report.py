"""``ftrun report`` and the history section of ``ftrun status``: a job's faults, recoveries and
where its time went, rendered from :mod:`ftrun.cli.history` (the job's event log only).

Plain functions the typer layer calls; JSON goes through ``sys.stdout.write`` (never rich).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from ftrun import exit_codes, jobs
from ftrun.cli import history as hist
from ftrun.cli.status import _HOW, _cell, _console, _liveness, _ranks_text, _s, history_lines
from ftrun.errors import ConfigError, FtrunError

# The time split's parts, in the order a job meets them, as the report names them.
_PARTS = (("startup_s", "startup (until the ranks first restored)"),
          ("rendezvous_wait_s", "waiting in rendezvous (outside recoveries)"),
          ("detection_s", "detection"),
          ("recovery_abort_s", "recovery: abort"),
          ("recovery_rendezvous_s", "recovery: rendezvous"),
          ("recovery_new_world_s", "recovery: new world"),
          ("recovery_in_place_attempt_s", "recovery: in-place attempt"),
          ("recovery_restart_s", "recovery: restart"),
          ("restore_s", "recovery: restart of training (until the snapshot restored)"),
          ("recovery_unphased_s", "recovery without a recovery event"),
          ("snapshot_blocked_s", "blocked by snapshots"),
          ("recompute_s", "recomputed steps"),
          ("training_s", "training"))


def _fail(e: FtrunError, command: str) -> int:
    sys.stderr.write(f"ftrun {command}: {e}\n")
    sys.stderr.flush()
    return exit_codes.for_error(e)


def render_report(doc: dict[str, Any]) -> Group:
    history, split, proj = doc["history"], doc["time"], doc["projected"]
    wall = split["wall_s"]
    table = Table(box=None, pad_edge=False, title_justify="left")
    for column in ("where the time went", "seconds", "share"):
        table.add_column(column, no_wrap=True, justify="left" if column[0] == "w" else "right")
    for key, name in _PARTS:
        value = split.get(key)
        if value == 0.0 and key not in ("training_s", "detection_s"):
            continue
        table.add_row(name, _s(value, ""),
                      "" if value is None or wall <= 0 else f"{100 * value / wall:.1f}%")
    table.add_row(Text("wall time", style="bold"), f"{wall:.2f}", "100.0%")
    beside = split.get("beside") or {}
    if beside.get("spares"):
        # Not a part of the wall time: the job trained meanwhile, on other machines.
        never = beside.get("spares_never_took_over") or 0
        table.add_row(Text(f"spares waiting ({beside['spares']} launcher(s)"
                           + (f", {never} never took over" if never else "")
                           + "; beside the wall time)", style="dim"),
                      _s(beside.get("spare_wait_s"), ""), "")
    ettr = split.get("ettr")
    ettr_line = Text.assemble(
        ("effective training time ratio: ", "bold"),
        (f"{ettr:.3f} measured" if ettr is not None else f"{hist.NOT_RECORDED} measured", ""),
        (f" ({split['ettr_note']})", "dim"),
    )
    model = (f"{proj['ettr']:.3f} projected by {proj['model']}" if proj.get("ettr") is not None
             else f"no projection: {proj.get('why')}")
    if proj.get("ettr") is not None and split.get("startup_s"):
        model += f"; the model counts no startup (measured {split['startup_s']:.2f} s)"
    faults = Table(box=None, pad_edge=False)
    for column in ("#", "kind", "rank/host", "detected after", "recovered after", "how",
                   "resumed from", "steps lost"):
        faults.add_column(column, no_wrap=True)
    for f in history["faults"]:
        how = str((f.get("recovery") or {}).get("how") or "-")
        who = (f"rank {_ranks_text(f['ranks'])}" if f["ranks"] else "-") + \
            (f" / {f['host']}" if f.get("host") else "")
        faults.add_row(str(f["n"]), f["kind"], _cell(who), _s(f["detected_after_s"]),
                       _s(f["recovered_after_s"]), _HOW.get(how, how),
                       "-" if f["resumed_from"] is None
                       else f"{f['resumed_from']} ({f['restored_from']})",
                       hist.NOT_RECORDED if f["steps_lost"] is None else str(f["steps_lost"]))
    commits = _commits_line(history)
    missing = Text("not recorded in the event log: " + "; ".join(doc["missing"].values()),
                   style="dim")
    parts: list[Any] = [*history_lines(history, doc["run_id"]), *commits, Text(""), table,
                        ettr_line, Text(model, style="dim"), Text("")]
    parts += [faults] if history["faults"] else [Text("no faults")]
    return Group(*parts, missing)


def _commits_line(history: dict[str, Any]) -> list[Text]:
    """"snapshots committed: N, the last step S at +T s"; nothing when none was recorded."""
    count, last = history.get("snapshots_committed"), history.get("last_commit")
    if count is None:
        return []
    text = f"snapshots committed: {count}"
    if last is not None:
        text += f", the last step {last['step']} at +{last['at'] - history['started_at']:.1f} s"
    return [Text(text, style="dim")]


def run_report(run_id: str, *, json_out: bool, state_dir: str | None,
               html: str | None = None) -> int:
    """``ftrun report RUN_ID``: the job's time accounting, from its event log; with ``html``
    also written to that file as one self-contained page."""
    try:
        job = jobs.read_job_file(run_id, state_dir)
        events = hist.read_events(run_id, state_dir)
    except FtrunError as e:
        return _fail(e, "report")
    doc = hist.report(events, run_id, gone=_liveness(job) is False)
    if html:
        from ftrun.cli.report_html import render_html

        path = Path(html).expanduser()
        try:
            path.write_text(render_html(doc), encoding="utf-8")
        except OSError as e:
            return _fail(ConfigError(f"--html {html}: cannot write it ({e.strerror or e}); "
                                     "pick a writable path"), "report")
    if json_out:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()
    elif html:
        sys.stdout.write(f"ftrun report: wrote {path}\n")
        sys.stdout.flush()
    else:
        _console().print(render_report(doc))
    return exit_codes.OK
