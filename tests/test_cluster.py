"""tfdist.cluster: TF_CONFIG / Slurm / DTENSOR_* parsing, building and validation (pure Python, fast)."""

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tfdist import cli, cluster
from tfdist.errors import UsageError

REPO = Path(__file__).resolve().parents[1]


def tf_config(cluster_spec, task_type="worker", index=0) -> str:
    return json.dumps({"cluster": cluster_spec, "task": {"type": task_type, "index": index}})


def listening_socket():
    """A socket bound and listening on a free loopback port: 'another process' holding it."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    return holder


# --------------------------------------------------------------------------- parse_tf_config

def test_parse_workers_only_makes_worker_0_the_chief():
    config = cluster.parse_tf_config(tf_config({"worker": ["a:1", "b:2", "c:3"]}, "worker", 0))
    assert config.num_workers == 3
    assert config.is_chief and config.rank == 0
    assert config.worker_addresses == ["a:1", "b:2", "c:3"]
    other = cluster.parse_tf_config(tf_config({"worker": ["a:1", "b:2", "c:3"]}, "worker", 2))
    assert not other.is_chief and other.rank == 2 and other.address == "c:3"


def test_parse_with_chief_ranks_the_chief_first():
    spec = {"worker": ["b:2", "c:3"], "chief": ["a:1"], "ps": ["p:9"]}
    chief = cluster.parse_tf_config(tf_config(spec, "chief", 0))
    worker0 = cluster.parse_tf_config(tf_config(spec, "worker", 0))
    assert chief.is_chief and chief.rank == 0
    assert not worker0.is_chief and worker0.rank == 1
    assert chief.num_workers == 3 and chief.worker_addresses == ["a:1", "b:2", "c:3"]
    assert cluster.parse_tf_config(tf_config(spec, "ps", 0)).rank is None


def test_parse_accepts_evaluator_outside_the_cluster_and_roundtrips():
    config = cluster.parse_tf_config(tf_config({"worker": ["a:1"]}, "evaluator", 0))
    assert config.address is None and not config.is_chief
    assert cluster.parse_tf_config(config.to_json()) == config


@pytest.mark.parametrize("text, expected", [
    ('{"cluster": {"worker": ["a:1"]', "not valid JSON"),
    ("", "TF_CONFIG is empty"),
    ("[1, 2]", "must be a JSON object"),
    ('{"task": {"type": "worker", "index": 0}}', 'no "cluster" key'),
    ('{"cluster": {}, "task": {"type": "worker", "index": 0}}', "non-empty object"),
    ('{"cluster": {"worker": ["a:1"]}}', 'no "task"'),
    (tf_config({"worker": ["a:1"]}, "boss"), "task type 'boss' is unknown. Valid types: chief, worker, ps"),
    (tf_config({"worker": ["a:1"]}, "chief"), "'chief' is not in the cluster"),
    (tf_config({"worker": ["a:1"], "master": ["m:1"]}), "unknown task type 'master'"),
    (tf_config({"worker": ["a:1", "b:2", "c:3"]}, "worker", 3), "index 3 is outside the cluster"),
    (tf_config({"worker": ["a:1", "b:2", "c:3"]}, "worker", -1), "valid range is 0..2"),
    (tf_config({"worker": ["a:1"]}, "worker", "0"), "index must be an integer"),
    (tf_config({"worker": ["a:1"], "chief": ["c:1", "d:1"]}, "worker"), "at most one is allowed"),
    (tf_config({"worker": "a:1"}), "must be a non-empty list"),
    (tf_config({"ps": ["p:1"]}, "ps"), 'no "chief" or "worker" task'),
])
def test_parse_rejects_with_a_clear_message(text, expected):
    with pytest.raises(UsageError) as error:
        cluster.parse_tf_config(text)
    assert expected in str(error.value)


def test_malformed_json_message_shows_the_received_value():
    with pytest.raises(UsageError) as error:
        cluster.parse_tf_config("{cluster: nope}")
    assert "not valid JSON" in str(error.value) and "{cluster: nope}" in str(error.value)


def test_index_out_of_range_names_the_valid_range():
    with pytest.raises(UsageError) as error:
        cluster.parse_tf_config(tf_config({"worker": ["a:1", "b:2"]}, "worker", 5))
    assert "index 5" in str(error.value) and "0..1" in str(error.value)


@pytest.mark.parametrize("address, expected", [
    ("node01", 'is not "host:port"'),
    ("node01:http", 'is not "host:port"'),
    ("node01:70000", "valid ports are 1..65535"),
    ("node01:0", "valid ports are 1..65535"),
    (":2222", 'is not "host:port"'),
    ("::1:2222", "IPv6 host in brackets"),
    ("bad host:2222", "invalid host"),
    (7, 'must be a "host:port" string'),
])
def test_bad_addresses_are_named(address, expected):
    with pytest.raises(UsageError) as error:
        cluster.parse_tf_config(tf_config({"worker": ["ok:1", address]}))
    assert expected in str(error.value)
    assert "worker:1" in str(error.value)


def test_ipv6_addresses_in_brackets_are_fine():
    config = cluster.parse_tf_config(tf_config({"worker": ["[::1]:2222", "[::1]:2223"]}))
    assert cluster.split_address(config.address) == ("::1", 2222)


def test_duplicate_addresses_are_rejected_across_task_types():
    with pytest.raises(UsageError) as error:
        cluster.parse_tf_config(tf_config({"chief": ["a:1"], "worker": ["b:2", "a:1"]}))
    message = str(error.value)
    assert "Duplicate address 'a:1'" in message and "chief:0" in message and "worker:1" in message


# --------------------------------------------------------------------------- check_own_port_free

def test_taken_port_of_a_local_task_is_reported():
    with listening_socket() as holder:
        port = holder.getsockname()[1]
        text = tf_config({"worker": ["127.0.0.1:1", f"localhost:{port}"]}, "worker", 1)
        with pytest.raises(UsageError) as error:
            cluster.check_own_port_free(text)
    assert f"port {port} of task worker:1 is already taken by another process" in str(error.value)


def test_free_port_and_remote_hosts_pass():
    with listening_socket() as holder:
        port = holder.getsockname()[1]
    cluster.check_own_port_free(tf_config({"worker": [f"127.0.0.1:{port}"]}))
    # A remote host's port cannot be probed by binding here, so it is not checked.
    with listening_socket() as holder:
        taken = holder.getsockname()[1]
        cluster.check_own_port_free(tf_config({"worker": [f"node-elsewhere.example:{taken}"]}))


def test_local_host_detection():
    assert all(cluster.is_local_host(host) for host in ("localhost", "127.0.0.1", "127.3.2.1", "::1",
                                                         socket.gethostname()))
    assert not cluster.is_local_host("10.1.2.3") and not cluster.is_local_host("node07")


# --------------------------------------------------------------------------- build_tf_config

@pytest.mark.parametrize("chief", [False, True])
def test_build_tf_config_ranks_agree_and_are_distinct(chief):
    hosts = ["n1:2222", "n2:2222", "n3:2222"]
    configs = [cluster.parse_tf_config(cluster.build_tf_config(hosts, rank, chief)) for rank in range(3)]
    assert len({json.dumps(config.cluster, sort_keys=True) for config in configs}) == 1
    assert [config.rank for config in configs] == [0, 1, 2]
    assert [config.address for config in configs] == hosts
    assert [config.is_chief for config in configs] == [True, False, False]
    assert configs[0].task_type == ("chief" if chief else "worker")


def test_build_tf_config_validates():
    with pytest.raises(UsageError, match=r"Index 3 is outside the cluster of 3 host\(s\); the valid range is 0..2"):
        cluster.build_tf_config(["a:1", "b:1", "c:1"], 3, False)
    with pytest.raises(UsageError, match="Duplicate address"):
        cluster.build_tf_config(["a:1", "a:1"], 0, False)
    with pytest.raises(UsageError, match="empty"):
        cluster.build_tf_config([], 0, False)


def test_tf_config_cli_is_consistent_across_ranks(capsys):
    outputs = []
    for rank in range(3):
        assert cli.main(["tf-config", "--hosts", "h0:2222,h1:2222,h2:2222", "--index", str(rank)]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert all(output["cluster"] == {"worker": ["h0:2222", "h1:2222", "h2:2222"]} for output in outputs)
    assert [output["task"] for output in outputs] == [{"type": "worker", "index": i} for i in range(3)]


def test_tf_config_cli_chief_ranges_and_errors(capsys):
    assert cli.main(["tf-config", "--hosts", "pod-[0-2].svc", "--port", "2222", "--index", "0", "--chief"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "cluster": {"chief": ["pod-0.svc:2222"], "worker": ["pod-1.svc:2222", "pod-2.svc:2222"]},
        "task": {"type": "chief", "index": 0}}
    assert cli.main(["tf-config", "--hosts", "a:1,b:2,c:3", "--index", "3"]) == 2
    assert "valid range is 0..2" in capsys.readouterr().err
    assert cli.main(["tf-config", "--hosts", "a:1"]) == 2
    assert "--index is required" in capsys.readouterr().err


# --------------------------------------------------------------------------- host lists and Slurm

@pytest.mark.parametrize("text, hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("node[01-02],gpu5,cpu[8-10]", ["node01", "node02", "gpu5", "cpu8", "cpu9", "cpu10"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("job-[0-1].svc:2222", ["job-0.svc:2222", "job-1.svc:2222"]),
    ("single", ["single"]),
])
def test_expand_hostlist(text, hosts):
    assert cluster.expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, expected", [
    ("node[01-03", "unclosed"), ("node01]", "unbalanced"), ("node[3-1]", "backwards"),
    ("node[a-b]", "not N or N-M"), ("a,,b", "empty entry"), ("", "Empty host list"),
])
def test_expand_hostlist_errors(text, expected):
    with pytest.raises(UsageError, match=re.escape(expected)):
        cluster.expand_hostlist(text)


def slurm_env(procid, nodelist="node[01-04]", ntasks=4, **extra):
    return dict({"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks), "SLURM_JOB_NODELIST": nodelist}, **extra)


def test_slurm_every_rank_agrees_on_the_cluster():
    configs = []
    for procid in range(4):
        task = cluster.from_slurm_env(slurm_env(procid), port=2222)
        configs.append(cluster.parse_tf_config(cluster.build_tf_config(task.hosts, task.index, chief=False)))
    assert {tuple(config.worker_addresses) for config in configs} == {
        ("node01:2222", "node02:2222", "node03:2222", "node04:2222")}
    assert [config.task_index for config in configs] == [0, 1, 2, 3]


def test_slurm_several_tasks_per_node_get_consecutive_ports():
    env = slurm_env(2, nodelist="gpu[1-2]", ntasks=4, SLURM_TASKS_PER_NODE="2(x2)")
    task = cluster.from_slurm_env(env, port=3000)
    assert task.hosts == ["gpu1:3000", "gpu1:3001", "gpu2:3000", "gpu2:3001"] and task.index == 2


def test_slurm_step_nodelist_wins_over_the_job_nodelist():
    env = slurm_env(0, nodelist="node[01-08]", ntasks=2, SLURM_STEP_NODELIST="node[03-04]",
                    SLURM_STEP_NUM_TASKS="2")
    assert cluster.from_slurm_env(env).hosts == [f"node03:{cluster.DEFAULT_PORT}", f"node04:{cluster.DEFAULT_PORT}"]


@pytest.mark.parametrize("env, expected", [
    ({"SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]"}, "SLURM_PROCID is not set"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "NODELIST is not set"),
    (slurm_env(0, nodelist="n[1-2]", ntasks=3), "do not spread evenly"),
    (slurm_env(4), "outside 0..3"),
    (slurm_env("x"), "non-negative integer"),
])
def test_slurm_errors(env, expected):
    with pytest.raises(UsageError, match=re.escape(expected)):
        cluster.from_slurm_env(env)


# --------------------------------------------------------------------------- DTensor

def test_dtensor_env_roundtrips_through_the_validator():
    addresses = ["127.0.0.1:1001", "127.0.0.1:1002", "127.0.0.1:1003"]
    for client in range(3):
        env = cluster.dtensor_env(addresses, client)
        assert env == {"DTENSOR_CLIENT_ID": str(client), "DTENSOR_NUM_CLIENTS": "3",
                       "DTENSOR_JOB_NAME": "worker", "DTENSOR_JOBS": ",".join(addresses)}
        parsed = cluster.validate_dtensor_env(env)
        assert (parsed.client_id, parsed.num_clients, parsed.jobs) == (client, 3, addresses)
    assert cluster.validate_dtensor_env({"PATH": "/bin"}) is None


@pytest.mark.parametrize("env, expected", [
    ({"DTENSOR_CLIENT_ID": "2", "DTENSOR_JOBS": "a:1,b:2"}, "outside 0..1"),
    ({"DTENSOR_CLIENT_ID": "0", "DTENSOR_NUM_CLIENTS": "3", "DTENSOR_JOBS": "a:1,b:2"}, "lists 2 client"),
    ({"DTENSOR_CLIENT_ID": "x", "DTENSOR_JOBS": "a:1"}, "DTENSOR_CLIENT_ID must be an integer"),
    ({"DTENSOR_JOBS": "a:1,a:1"}, "Duplicate address"),
    ({"DTENSOR_JOBS": "a,b:2"}, 'is not "host:port"'),
    ({"DTENSOR_NUM_CLIENTS": "2"}, "lists 0 client"),
])
def test_dtensor_validator_errors(env, expected):
    with pytest.raises(UsageError, match=re.escape(expected)):
        cluster.validate_dtensor_env(env)


def test_dtensor_env_validates_its_arguments():
    with pytest.raises(UsageError, match="outside 0..1"):
        cluster.dtensor_env(["a:1", "b:2"], 2)


# --------------------------------------------------------------------------- import cost

def test_cluster_cli_and_launch_do_not_import_tensorflow():
    code = ("import sys, tfdist.cluster, tfdist.cli, tfdist.launch; "
            "sys.exit('tensorflow' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
