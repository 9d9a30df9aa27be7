"""Unit tests for ftrun.launcher.slurm: hostlist expansion and SLURM_* derivation."""

from __future__ import annotations

import pytest

from ftrun.errors import ConfigError
from ftrun.launcher.slurm import MAX_HOSTS, SlurmDerived, derive, parse_hostlist

HOSTLIST_CASES: list[tuple[str, list[str]]] = [
    ("", []),
    ("   ", []),
    ("node1", ["node1"]),
    ("a,b,c", ["a", "b", "c"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[1-3,010-011]", ["n1", "n2", "n3", "n010", "n011"]),
    ("n[007]", ["n007"]),
    ("n[1,3,5]", ["n1", "n3", "n5"]),
    ("n[3,1-2]", ["n3", "n1", "n2"]),
    (
        "rack[1-2]-n[01-02]",
        ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"],
    ),
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
    ("n[1-2]x[5]y", ["n1x5y", "n2x5y"]),
    ("gpu-a100.n[1-2]", ["gpu-a100.n1", "gpu-a100.n2"]),
    ("n[1-2] m[3-4]", ["n1", "n2", "m3", "m4"]),
    ("n1\tn2\nn3", ["n1", "n2", "n3"]),
    ("n1 , n2 ,n3", ["n1", "n2", "n3"]),
    ("n1,,n2,", ["n1", "n2"]),
    ("n[1-2],login,gpu[10-11]", ["n1", "n2", "login", "gpu10", "gpu11"]),
    ("n[1-2],n[2-3]", ["n1", "n2", "n2", "n3"]),
    ("n[1,1]", ["n1", "n1"]),
    ("[1-2]", ["1", "2"]),
    ("n[ 1 - 2 , 4 ]", ["n1", "n2", "n4"]),
    ("n[5-5]", ["n5"]),
    ("n[099-101]", ["n099", "n100", "n101"]),
    ("a[1-2]b[1-2]c[1-2]", [f"a{i}b{j}c{k}" for i in (1, 2) for j in (1, 2) for k in (1, 2)]),
]


@pytest.mark.parametrize(
    ("expr", "expected"), HOSTLIST_CASES, ids=[c[0] or "<empty>" for c in HOSTLIST_CASES]
)
def test_parse_hostlist(expr: str, expected: list[str]) -> None:
    assert parse_hostlist(expr) == expected


MALFORMED = [
    "n[1-3",
    "n1-3]",
    "n[1-[2]]",
    "n[[1]]",
    "n[]",
    "n[1,,2]",
    "n[1,]",
    "n[,1]",
    "n[5-3]",
    "n[a-c]",
    "n[1-b]",
    "n[x]",
    "n[1-2-3]",
    "n[-3]",
    "n[3-]",
    "n[1.5]",
    "n[1-2],m[",
    "n]1[",
]


@pytest.mark.parametrize("expr", MALFORMED)
def test_parse_hostlist_malformed(expr: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_hostlist(expr)
    assert repr(expr) in str(info.value)


def test_descending_range_message_suggests_fix() -> None:
    with pytest.raises(ConfigError, match=r"descending range '5-3'.*'3-5'"):
        parse_hostlist("n[5-3]")


def test_hostlist_size_is_bounded() -> None:
    with pytest.raises(ConfigError, match="more than"):
        parse_hostlist(f"n[0-{MAX_HOSTS}]")
    with pytest.raises(ConfigError, match="more than"):
        parse_hostlist("a[0-999]b[0-999]c[0-1]")


# --------------------------------------------------------------------------------------------
# derive()
# --------------------------------------------------------------------------------------------

SRUN_STEP: dict[str, str] = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[01-04]",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_NODELIST": "gpu[01-04]",
    "SLURM_NNODES": "4",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_STEP_NODELIST": "gpu[01-04]",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
    "SLURM_NODEID": "2",
}

BATCH_SCRIPT: dict[str, str] = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[01-04]",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_NODELIST": "gpu[01-04]",
    "SLURM_NNODES": "4",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS_PER_NODE": "8",
}


def test_not_under_slurm() -> None:
    assert derive({}) is None
    assert derive({"PATH": "/bin", "SLURM_NODEID": "1"}) is None
    assert derive({"SLURM_JOB_ID": ""}) is None


def test_srun_step() -> None:
    assert derive(SRUN_STEP) == SlurmDerived(
        nnodes="4",
        node_rank=2,
        rdzv_id="4242",
        rdzv_host="gpu01",
        job_id="4242",
        in_step=True,
        warnings=(),
    )


def test_srun_step_with_only_new_style_ids() -> None:
    env = {k: v for k, v in SRUN_STEP.items() if k != "SLURM_STEPID"}
    got = derive(env)
    assert got is not None and got.in_step


def test_batch_script_warns() -> None:
    got = derive(BATCH_SCRIPT)
    assert got is not None
    assert not got.in_step
    assert (got.nnodes, got.node_rank, got.rdzv_host, got.rdzv_id) == ("4", 0, "gpu01", "4242")
    assert len(got.warnings) == 1
    assert "srun --ntasks-per-node=1 ftrun" in got.warnings[0]


@pytest.mark.parametrize(
    "extra",
    [
        {"SLURM_STEP_ID": "4294967294"},  # the batch step's id
        {"SLURM_STEP_ID": "0"},  # no SLURM_STEP_NODELIST: not an srun step
    ],
)
def test_batch_step_ids_are_not_srun_steps(extra: dict[str, str]) -> None:
    got = derive({**BATCH_SCRIPT, **extra})
    assert got is not None and not got.in_step
    assert any("srun" in w for w in got.warnings)


def test_array_job_rdzv_id() -> None:
    env = {**SRUN_STEP, "SLURM_ARRAY_JOB_ID": "4200", "SLURM_ARRAY_TASK_ID": "7"}
    got = derive(env)
    assert got is not None
    assert got.rdzv_id == "4200_7"
    assert got.job_id == "4242"


def test_array_job_id_without_task_falls_back_to_job_id() -> None:
    got = derive({**SRUN_STEP, "SLURM_ARRAY_JOB_ID": "4200"})
    assert got is not None and got.rdzv_id == "4242"


def test_step_nodelist_differs_from_job_nodelist() -> None:
    env = {
        **SRUN_STEP,
        "SLURM_JOB_NODELIST": "gpu[01-06]",
        "SLURM_JOB_NUM_NODES": "6",
        "SLURM_NODELIST": "gpu[01-06]",
        "SLURM_NNODES": "6",
        "SLURM_STEP_NODELIST": "gpu[03-04]",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_NODEID": "1",
    }
    got = derive(env)
    assert got is not None
    assert (got.nnodes, got.node_rank, got.rdzv_host) == ("2", 1, "gpu03")
    assert got.warnings == ()


def test_nnodes_from_nodelist_when_no_count() -> None:
    env = {
        "SLURM_JOB_ID": "9",
        "SLURM_STEP_ID": "1",
        "SLURM_STEP_NODELIST": "a,b[1-2]",
        "SLURM_NODEID": "2",
    }
    got = derive(env)
    assert got is not None
    assert (got.nnodes, got.rdzv_host, got.in_step) == ("3", "a", True)


def test_node_rank_defaults_to_zero() -> None:
    env = {k: v for k, v in SRUN_STEP.items() if k != "SLURM_NODEID"}
    got = derive(env)
    assert got is not None and got.node_rank == 0


def test_several_tasks_per_node_warns() -> None:
    got = derive({**SRUN_STEP, "SLURM_STEP_TASKS_PER_NODE": "8(x4)"})
    assert got is not None
    assert len(got.warnings) == 1
    assert "one launcher per node" in got.warnings[0]
    got = derive(
        {
            **{k: v for k, v in SRUN_STEP.items() if k != "SLURM_STEP_TASKS_PER_NODE"},
            "SLURM_NTASKS_PER_NODE": "2",
        }
    )
    assert got is not None and len(got.warnings) == 1


def test_count_mismatch_warns() -> None:
    got = derive({**SRUN_STEP, "SLURM_STEP_NUM_NODES": "3", "SLURM_NODEID": "0"})
    assert got is not None
    assert got.nnodes == "3"
    assert any("names 4 hosts" in w for w in got.warnings)


@pytest.mark.parametrize("bad", ["x", "-1", "1.0", "", " ", "+1", "1_0"])
def test_bad_node_id(bad: str) -> None:
    env = {**SRUN_STEP, "SLURM_NODEID": bad}
    with pytest.raises(ConfigError, match="SLURM_NODEID"):
        derive(env)


def test_node_id_out_of_range() -> None:
    with pytest.raises(ConfigError, match="SLURM_NODEID=4 is not below the node count 4"):
        derive({**SRUN_STEP, "SLURM_NODEID": "4"})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SLURM_JOB_ID", "abc"),
        ("SLURM_STEP_NUM_NODES", "four"),
        ("SLURM_STEP_NUM_NODES", "0"),
        ("SLURM_ARRAY_TASK_ID", "x"),
    ],
)
def test_bad_integers(name: str, value: str) -> None:
    env = {**SRUN_STEP, "SLURM_ARRAY_JOB_ID": "4200", "SLURM_ARRAY_TASK_ID": "1", name: value}
    with pytest.raises(ConfigError, match=name):
        derive(env)


def test_missing_nodelist() -> None:
    with pytest.raises(ConfigError, match="rdzv-endpoint"):
        derive({"SLURM_JOB_ID": "1", "SLURM_NODEID": "0"})


def test_malformed_nodelist() -> None:
    with pytest.raises(ConfigError, match=r"gpu\[01-04"):
        derive({**SRUN_STEP, "SLURM_STEP_NODELIST": "gpu[01-04"})
