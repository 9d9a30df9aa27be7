"""The ``ftrun`` command: typer commands, thin, each handing off to a plain function.

``ftrun [TORCHRUN FLAGS] [FTRUN FLAGS] SCRIPT [ARGS]`` is the default command: anything that
is not a subcommand goes to the launcher, whose flags are torchrun's own parser (so they keep
torchrun's exact spellings, defaults and errors). ``ftrun --help`` shows those flags.
Library errors (:class:`ftrun.errors.FtrunError`) become one line on stderr and an exit code.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from ftrun import errors, exit_codes, log

LAUNCH = "launch"


class _DefaultToLaunch(TyperGroup):
    """Route everything that is not a subcommand to the hidden ``launch`` command."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        # `ftrun --help` shows the launcher's flags: that is what torchrun users look for.
        if args and args[0] not in self.commands:
            args = [LAUNCH, *args]
        return super().parse_args(ctx, args)


app = typer.Typer(
    cls=_DefaultToLaunch,
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    help="ftrun: a fault-tolerant drop-in for torchrun. "
    "Run `ftrun --help` for the launcher's flags (torchrun's, plus ftrun's).",
)


def _fail(e: errors.FtrunError) -> int:
    sys.stderr.write(f"ftrun: error: {e}\n")
    return exit_codes.for_error(e)


@app.command(
    LAUNCH, hidden=True, add_help_option=False,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                      "allow_interspersed_args": False},
)
def launch_command(ctx: typer.Context) -> None:
    """Launch one node of a job (the default command)."""
    from ftrun.launcher.launch import run

    log.configure()
    try:
        code = run(list(ctx.args))
    except errors.FtrunError as e:
        code = _fail(e)
    # Everything the launcher started is stopped and reaped by now. Leave without the
    # interpreter's teardown: torch's C++ threads (rendezvous store, agent) can abort the
    # process while being destroyed after a signal, which would replace the exit code.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


@app.command("status")
def status_command(
    run_id: Annotated[str | None, typer.Argument(help="The job's run id; omit to list jobs.")] = None,
    endpoint: Annotated[str | None, typer.Option(help="Coordinator HOST:PORT (skips the job file).", envvar="FTRUN_COORDINATOR")] = None,
    etcd: Annotated[str | None, typer.Option(help="A job on --rdzv-backend etcd: its etcd members HOST:PORT[,HOST:PORT...], where the coordinator is found (skips the job file).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Write a versioned JSON document.")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh until Ctrl-C (JSON: one document per line).")] = False,
    no_headers: Annotated[bool, typer.Option("--no-headers", help="Omit the table header and summary.")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes under --watch.")] = 2.0,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the coordinator.")] = 5.0,
    state_dir: Annotated[str | None, typer.Option(help="State directory.", envvar="FTRUN_STATE_DIR")] = None,
    nodes: Annotated[str | None, typer.Option("--nodes", help="Which nodes to list: all, problems (lost, failed, restarting, suspect) or none. Default: all, but only problems in a table of a job of more than 64 nodes.")] = None,
    match: Annotated[str | None, typer.Option(help="Only nodes whose node id or host contains TEXT.")] = None,
    offset: Annotated[int, typer.Option(help="Skip this many of the selected nodes.")] = 0,
    limit: Annotated[int | None, typer.Option(help="List at most this many nodes (--json: all unless set).")] = None,
) -> None:
    """Show a job: its health and summary, and its nodes (ranks, states, restarts, heartbeats). The exit code is its health."""
    from ftrun.cli.status import run_status

    log.configure("WARNING")
    try:
        code = run_status(run_id, endpoint=endpoint, json_out=json_out, watch=watch,
                          no_headers=no_headers, state_dir=state_dir, interval_s=interval,
                          timeout_s=timeout, select=nodes, match=match, offset=offset,
                          limit=limit, etcd=etcd)
    except errors.FtrunError as e:
        code = _fail(e)
    raise typer.Exit(code)


@app.command("report")
def report_command(
    run_id: Annotated[str, typer.Argument(help="The job's run id (running or ended).")],
    json_out: Annotated[bool, typer.Option("--json", help="Write a versioned JSON document.")] = False,
    html: Annotated[str | None, typer.Option("--html", help="Also write the report to FILE as one self-contained HTML page, with a timeline (inline SVG).")] = None,
    state_dir: Annotated[str | None, typer.Option(help="State directory.", envvar="FTRUN_STATE_DIR")] = None,
) -> None:
    """Where a job's time went, from its event log: training, detection, each recovery phase, waiting; its effective training time ratio beside bench/ettr.py's projection; one row per fault."""
    from ftrun.cli.report import run_report

    log.configure("WARNING")
    try:
        code = run_report(run_id, json_out=json_out, state_dir=state_dir, html=html)
    except errors.FtrunError as e:
        code = _fail(e)
    raise typer.Exit(code)


@app.command("inspect")
def inspect_command(
    target: Annotated[str, typer.Argument(help="A live job's run id (this host's snapshots), or a persisted checkpoint directory.")],
    step: Annotated[int | None, typer.Option(help="The step to show (default: the newest complete one).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Write a versioned JSON document.")] = False,
    verify: Annotated[bool, typer.Option("--verify", help="Re-hash the step (every tensor on disk, every chunk in memory) and report mismatches.")] = False,
    state_dir: Annotated[str | None, typer.Option(help="State directory.", envvar="FTRUN_STATE_DIR")] = None,
) -> None:
    """Show the snapshots of a live job or a persisted checkpoint: steps, ranks, tensors, hashes."""
    from ftrun.cli.inspect import run_inspect

    log.configure("WARNING")
    try:
        code = run_inspect(target, step=step, json_out=json_out, verify=verify,
                           state_dir=state_dir)
    except errors.FtrunError as e:
        code = _fail(e)
    raise typer.Exit(code)


@app.command("coordinator")
def coordinator_command(
    rdzv_endpoint: Annotated[str, typer.Option("--rdzv-endpoint", help="HOST:PORT to host the job's rendezvous store on; launchers pass the same --rdzv-endpoint.")],
    rdzv_id: Annotated[str, typer.Option("--rdzv-id", help="The job's run id (launchers' --rdzv-id).")],
    bind_host: Annotated[str | None, typer.Option(help="Address the coordinator binds (default: the address the --rdzv-endpoint host resolves to, where launchers reach the job; 0.0.0.0 for every interface).")] = None,
    node_timeout: Annotated[float, typer.Option(help="Seconds of silence before a node is reported lost.", envvar="FTRUN_NODE_TIMEOUT")] = 10.0,
    state_dir: Annotated[str | None, typer.Option(help="State directory.", envvar="FTRUN_STATE_DIR")] = None,
    on_hang: Annotated[str, typer.Option(help="What to do about a hung rank the collectives name: warn, restart (kill it; every rank restarts from the snapshot) or isolate (also exclude its host).", envvar="FTRUN_ON_HANG")] = "restart",
    on_slow: Annotated[str, typer.Option(help="What to do about a slow rank or host the collectives and probes name: warn or isolate.", envvar="FTRUN_ON_SLOW")] = "warn",
    on_corruption: Annotated[str, typer.Option(help="What to do when data-parallel replicas disagree at a snapshot (silent data corruption): warn, restart (the job resumes from the newest step the replicas agreed on; a host named twice is isolated) or isolate.", envvar="FTRUN_ON_CORRUPTION")] = "restart",
    isolate_hook: Annotated[str | None, typer.Option(help="Shell command run with an isolated host's name as its argument (e.g. a Slurm drain).", envvar="FTRUN_ISOLATE_HOOK")] = None,
    busy_hang_timeout: Annotated[float, typer.Option(help="Seconds the others may wait in a collective for a rank that is alive and in no collective (saving, evaluating, spinning) before it is named hung.", envvar="FTRUN_BUSY_HANG_TIMEOUT")] = 60.0,
) -> None:
    """Run a job's coordinator and rendezvous store on this host, until SIGTERM/Ctrl-C."""
    from ftrun.coordinator.detect import DetectConfig
    from ftrun.coordinator.server import run_standalone

    log.configure()
    try:
        detection = DetectConfig(on_hang=on_hang, on_slow=on_slow, on_corruption=on_corruption,
                                 isolate_hook=isolate_hook or None,
                                 busy_hang_s=busy_hang_timeout)
        code = run_standalone(rdzv_id, rdzv_endpoint, state_dir=state_dir,
                              node_timeout_s=node_timeout, bind_host=bind_host,
                              detection=detection)
    except errors.FtrunError as e:
        code = _fail(e)
    raise typer.Exit(code)


@app.command("completions")
def completions_command(
    shell: Annotated[str, typer.Argument(help="bash, zsh or fish.")],
) -> None:
    """Print the shell completion script for SHELL."""
    from ftrun.cli.completions import build_model, generate

    try:
        sys.stdout.write(generate(shell, lambda: build_model(app)))
    except errors.FtrunError as e:
        raise typer.Exit(_fail(e)) from None


def main(argv: list[str] | None = None) -> Any:
    logging.captureWarnings(True)
    return app(args=argv, prog_name="ftrun")


if __name__ == "__main__":
    main()
