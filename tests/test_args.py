"""Every torchrun flag means the same under ftrun; ftrun's own flags never collide."""

from __future__ import annotations

import argparse

import pytest
from torch.distributed.run import get_args_parser

from ftrun.errors import ConfigError
from ftrun.launcher import args as fargs

SCRIPT = ["train.py", "--lr", "0.1", "--nnodes", "7"]


def _sample(action: argparse.Action) -> list[str]:
    """A value for the flag that differs from its default."""
    if action.nargs == 0:
        return []
    samples = {
        "nnodes": "2:4", "nproc_per_node": "3", "rdzv_backend": "c10d",
        "rdzv_endpoint": "node7:1234", "rdzv_id": "job42", "rdzv_conf": "join_timeout=5",
        "max_restarts": "3", "monitor_interval": "0.5", "start_method": "fork",
        "event_log_handler": "console", "role": "trainer", "log_dir": "/tmp/logs",
        "redirects": "3", "tee": "1:3", "local_ranks_filter": "0,1",
        "node_rank": "1", "master_addr": "10.0.0.1", "master_port": "1234",
        "local_addr": "10.0.0.2", "logs_specs": "custom", "numa_binding": "node",
        "signals_to_handle": "SIGTERM", "shutdown_timeout": "5",
        "duplicate_stdout_filters": "abc", "duplicate_stderr_filters": "def",
    }
    if action.dest not in samples:
        raise AssertionError(f"torchrun grew flag {action.option_strings}; add a sample here")
    return [samples[action.dest]]


def _torch_flags() -> list[argparse.Action]:
    return [a for a in get_args_parser()._actions if a.option_strings and a.dest != "help"]


@pytest.mark.parametrize("action", _torch_flags(), ids=lambda a: a.option_strings[-1])
def test_every_torchrun_flag_maps_to_the_same_value(action: argparse.Action) -> None:
    ours, theirs = fargs.build_parser(), get_args_parser()
    for spelling in action.option_strings:
        argv = [spelling, *_sample(action), *SCRIPT]
        got, want = ours.parse_args(argv), theirs.parse_args(argv)
        for dest, value in vars(want).items():
            assert getattr(got, dest) == value, (spelling, dest)


def test_defaults_match_torchrun() -> None:
    got = vars(fargs.build_parser().parse_args(SCRIPT))
    want = vars(get_args_parser().parse_args(SCRIPT))
    assert {k: got[k] for k in want} == want
    assert got["training_script_args"] == ["--lr", "0.1", "--nnodes", "7"]


def test_pet_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NPROC_PER_NODE", "5")
    monkeypatch.setenv("PET_MAX_RESTARTS", "2")
    ns = fargs.build_parser().parse_args(SCRIPT)
    assert ns.nproc_per_node == "5" and ns.max_restarts == 2
    assert {"nproc_per_node", "max_restarts"} <= fargs.explicit_dests(fargs.build_parser(), SCRIPT)


def test_unknown_flag_fails_like_torchrun(capsys: pytest.CaptureFixture[str]) -> None:
    for parser in (fargs.build_parser(), get_args_parser()):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["--no-such-flag", "train.py"])
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("unrecognized arguments: --no-such-flag") == 2 or "--no-such-flag" in err


def test_ftrun_flags_do_not_collide_and_have_env() -> None:
    torch_flags = {s for a in get_args_parser()._actions for s in a.option_strings}
    assert not torch_flags.intersection(fargs.ftrun_flag_names())
    for _flag, knob, _typ, _help in fargs._FTRUN_FLAGS:
        assert knob.name.startswith("FTRUN_")


def test_ftrun_flag_env_and_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTRUN_HANG_TIMEOUT", "7")
    ns = fargs.build_parser().parse_args(SCRIPT)
    assert fargs.ftrun_options(ns).hang_timeout_s == 7.0
    ns = fargs.build_parser().parse_args(["--hang_timeout", "3", *SCRIPT])
    assert fargs.ftrun_options(ns).hang_timeout_s == 3.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hang-timeout", "-1"], "--hang-timeout must be >= 0"),
        (["--heartbeat-interval", "0"], "--heartbeat-interval must be > 0"),
        (["--node-timeout", "1", "--heartbeat-interval", "2"], "must exceed --heartbeat-interval"),
        (["--coordinator", "nohostport"], "--coordinator must be HOST:PORT"),
    ],
)
def test_bad_ftrun_values_name_the_value(argv: list[str], message: str) -> None:
    ns = fargs.build_parser().parse_args([*argv, *SCRIPT])
    with pytest.raises(ConfigError, match=message):
        fargs.ftrun_options(ns)


def test_explicit_dests_stop_at_the_script() -> None:
    parser = fargs.build_parser()
    given = fargs.explicit_dests(parser, ["--nnodes", "2", "--standalone", "train.py", "--rdzv-id", "x"])
    assert given >= {"nnodes", "standalone"}
    assert "rdzv_id" not in given


@pytest.mark.parametrize("env, argv, expected", [
    (None, [], None), ("auto", [], None), ("1", [], True), ("off", [], False),
    ("0", ["--warm-workers"], True), ("1", ["--no-warm-workers"], False),
])
def test_warm_workers_flag_variable_and_auto(monkeypatch: pytest.MonkeyPatch, env: str | None,
                                             argv: list[str], expected: bool | None) -> None:
    """Neither flag nor variable, or FTRUN_WARM_WORKERS=auto: None, decided by the CPUs per
    local rank when the workers start; the flags win over the variable."""
    if env is None:
        monkeypatch.delenv("FTRUN_WARM_WORKERS", raising=False)
    else:
        monkeypatch.setenv("FTRUN_WARM_WORKERS", env)
    ns = fargs.build_parser().parse_args([*argv, *SCRIPT])
    assert fargs.ftrun_options(ns).warm_workers is expected


def test_warm_workers_bad_variable_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTRUN_WARM_WORKERS", "sometimes")
    ns = fargs.build_parser().parse_args(SCRIPT)
    with pytest.raises(ConfigError, match="FTRUN_WARM_WORKERS must be 1, 0 or auto, got 'sometimes'"):
        fargs.ftrun_options(ns)


def test_warm_workers_auto_needs_four_cpus_per_local_rank() -> None:
    from ftrun.launcher.warm import auto_warm

    assert auto_warm(1, cpus=4) and auto_warm(8, cpus=32) and auto_warm(2, cpus=16)
    assert not auto_warm(3, cpus=2) and not auto_warm(8, cpus=31)
