"""Launcher decisions before any process starts: Slurm defaults, store placement, script checks."""

from __future__ import annotations

import socket

import pytest

from ftrun.errors import ConfigError
from ftrun.launcher import launch
from ftrun.launcher.args import build_parser, explicit_dests

SLURM = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "1",
}


def _args(argv: list[str]) -> tuple[object, set[str]]:
    parser = build_parser()
    return parser.parse_args(argv), explicit_dests(parser, argv)


def test_slurm_fills_what_the_user_left_out() -> None:
    args, explicit = _args(["--nproc-per-node", "4", "train.py"])
    launch.apply_slurm(args, explicit, SLURM)
    assert args.nnodes == "2" and args.rdzv_id == "4242" and args.rdzv_backend == "c10d"
    assert args.rdzv_endpoint == "gpu07:29500"


def test_flags_win_over_slurm() -> None:
    args, explicit = _args(["--nnodes", "2:4", "--rdzv-id", "mine", "--rdzv-endpoint", "h:1",
                            "--rdzv-backend", "c10d", "train.py"])
    launch.apply_slurm(args, explicit, SLURM)
    assert (args.nnodes, args.rdzv_id, args.rdzv_endpoint) == ("2:4", "mine", "h:1")


def test_batch_script_without_step_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    env = {k: v for k, v in SLURM.items() if "STEP" not in k}
    args, explicit = _args(["train.py"])
    launch.apply_slurm(args, explicit, env)
    assert args.nnodes == "1:1" and args.rdzv_backend == "static"
    assert "srun" in caplog.text


def test_under_slurm_only_node_0_hosts_the_store() -> None:
    # Both nodes' host resolves to this machine, so torch's rule would let node 1 bind too.
    env = {**SLURM, "SLURM_STEP_NODELIST": "localhost,localhost"}
    args, explicit = _args(["--nproc-per-node", "1", "train.py"])
    assert launch.apply_slurm(args, explicit, env)
    plan = launch.plan_rendezvous(args, explicit, external=False, node0_hosts=True)
    assert plan is not None and not plan.is_host and plan.store is None
    assert launch._parse_conf(args.rdzv_conf)["is_host"] == "0"


def test_under_slurm_node_0_refuses_a_taken_port() -> None:
    # Another job's store on node 0's port: joining it would tie the two jobs together.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {**SLURM, "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "localhost,localhost"}
        args, explicit = _args(["train.py"])
        assert launch.apply_slurm(args, explicit, env)
        args.rdzv_endpoint = f"localhost:{taken.getsockname()[1]}"
        with pytest.raises(ConfigError, match="Is another job using that port"):
            launch.plan_rendezvous(args, explicit, external=False, node0_hosts=True)


def test_slurm_endpoint_given_by_the_user_keeps_torchs_rule() -> None:
    args, explicit = _args(["--rdzv-endpoint", "203.0.113.9:29400", "train.py"])
    assert not launch.apply_slurm(args, explicit, SLURM)


def test_standalone_binds_the_store_here() -> None:
    args, explicit = _args(["--standalone", "train.py"])
    plan = launch.plan_rendezvous(args, explicit, external=False)
    assert plan is not None and plan.is_host and plan.port > 0
    assert args.rdzv_endpoint == f"localhost:{plan.port}" and not args.standalone


def test_c10d_conf_gets_tuned_defaults_but_user_values_win() -> None:
    args, explicit = _args(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                            "203.0.113.9:29400", "--rdzv-conf", "keep_alive_interval=7",
                            "train.py"])
    plan = launch.plan_rendezvous(args, explicit, external=False)
    conf = launch._parse_conf(args.rdzv_conf)
    assert conf["keep_alive_interval"] == "7"
    assert conf["keep_alive_max_attempt"] == "3" and conf["last_call_timeout"] == "5"
    assert plan is not None and not plan.is_host and conf["is_host"] == "0"


def test_external_coordinator_means_no_launcher_hosts() -> None:
    args, explicit = _args(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                            "localhost:1", "train.py"])
    plan = launch.plan_rendezvous(args, explicit, external=True)
    assert plan is not None and not plan.is_host


@pytest.mark.parametrize("argv, message", [
    (["missing.py"], "training script 'missing.py' not found"),
    (["--no-python", "no-such-binary-here"], "not found on PATH"),
])
def test_missing_script_is_a_clear_error(argv: list[str], message: str) -> None:
    args, _ = _args(argv)
    with pytest.raises(ConfigError, match=message):
        launch.check_script(args)


def test_bad_rdzv_conf_item() -> None:
    with pytest.raises(ConfigError, match="not KEY=VALUE"):
        launch._parse_conf("join_timeout")


def test_store_socket_fits_even_with_long_run_ids_and_tmpdirs(tmp_path, monkeypatch) -> None:
    node_dir = launch._node_dir("x" * 300)
    try:
        assert len(launch._store_url(node_dir)) <= 110
    finally:
        node_dir.rmdir()
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    assert launch._store_url(deep).startswith("ipc://@ftrun-")


def test_node_services_close_in_reverse_and_past_a_failure(
        caplog: pytest.LogCaptureFixture) -> None:
    node = launch.NodeServices.__new__(launch.NodeServices)  # no services: only the closing
    node._closers = []
    closed: list[str] = []

    def failing() -> None:
        closed.append("reporter")
        raise RuntimeError("boom")

    node._on_close("node directory", lambda: closed.append("directory"))
    node._on_close("node reporter", failing)
    node._on_close("snapshot store", lambda: closed.append("store"))
    node.close()
    node.close()  # idempotent
    assert closed == ["store", "reporter", "directory"]
    assert "closing the node reporter failed" in caplog.text and "boom" in caplog.text
