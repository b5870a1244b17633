"""The one configuration: every variable documented once, the documented table generated from the
registry, precedence (defaults < QUART_CONFIG file < environment < flags), validation with the
variable's name in the message, and the replica bounds defined once."""
from __future__ import annotations

import argparse
import os

import pytest

from contracts.config import (
    BY_NAME,
    VARIABLES,
    Bounds,
    ConfigError,
    ReplicaIdentity,
    add_arguments,
    child_environment,
    load_settings,
    replica_identity,
    settings_environment,
    settings_from_args,
)
from contracts.paths import REPO_ROOT
from tools.docs import CONFIGURATION, with_table


def test_the_configuration_table_is_the_registry():
    text = CONFIGURATION.read_text()
    assert with_table(text) == text, "run `make docs`"


def test_every_variable_is_documented_once_and_every_quart_variable_in_the_code_is_registered():
    assert len({v.env for v in VARIABLES}) == len(VARIABLES)
    assert all(v.doc and v.env.startswith("QUART_") for v in VARIABLES)
    import re
    used = set()
    for path in REPO_ROOT.rglob("*.py"):
        if ".venv" not in path.parts:
            used |= set(re.findall(r"\bQUART_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert used - {v.env for v in VARIABLES} == set()


def test_precedence_file_then_environment_then_flags(tmp_path):
    config = tmp_path / "quart.yml"
    config.write_text("redis_port: 7001\ntick_s: 3\nr_max: 40\n")
    s = load_settings(environ={"QUART_CONFIG": str(config), "QUART_TICK_S": "0.5"})
    assert s.redis.port == 7001 and s.autoscaler.tick_s == 0.5 and s.autoscaler.bounds == Bounds(1, 40)
    parser = argparse.ArgumentParser()
    add_arguments(parser, "redis_port")
    args = parser.parse_args(["--redis-port", "7002"])
    assert settings_from_args(args).redis.port == 7002


def test_secrets_folder_sits_between_the_file_and_the_environment(tmp_path):
    config = tmp_path / "quart.yml"
    config.write_text("redis_port: 7001\nredis_host: from-file\n")
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "QUART_REDIS_PASSWORD").write_text("s3cret\n")
    (secrets / "QUART_REDIS_HOST").write_text("redis.openfaas-fn")
    (secrets / "QUART_REDIS_PORT").write_text("7003")
    s = load_settings(environ={"QUART_CONFIG": str(config), "QUART_SECRETS_DIR": str(secrets),
                               "QUART_REDIS_PORT": "7004"})
    assert (s.redis.password, s.redis.host, s.redis.port) == ("s3cret", "redis.openfaas-fn", 7004)
    assert load_settings(environ={"QUART_SECRETS_DIR": str(tmp_path / "absent")}).redis.password == ""
    (secrets / "QUART_REDIS_PORT").write_text("not a port")
    with pytest.raises(ConfigError, match="QUART_REDIS_PORT"):
        load_settings(environ={"QUART_SECRETS_DIR": str(secrets)})


def test_settings_survive_a_trip_through_a_child_environment():
    s = load_settings(environ={}, policy_params={"kp": 0.3}, fork_cow=False, server_bandwidth=2e9, r_min=2)
    again = load_settings(environ=settings_environment(s))
    assert again == s


def test_a_child_keeps_the_callers_python_path_behind_the_repository(monkeypatch, tmp_path):
    """Packages a user put on PYTHONPATH (a --target install) are found by every process started."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(REPO_ROOT), ""]))
    env = child_environment(load_settings(environ={}))
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT), str(tmp_path)]
    monkeypatch.delenv("PYTHONPATH")
    assert child_environment(load_settings(environ={}))["PYTHONPATH"] == str(REPO_ROOT)


@pytest.mark.parametrize("mode", ["prefill", "all"])
def test_with_idle_cores_children_spin_openmp_briefly_unless_the_user_says_otherwise(monkeypatch, mode):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert "GOMP_SPINCOUNT" not in child_environment(load_settings(environ={"QUART_IDLE_CORES": "off"}))
    idle = load_settings(environ={"QUART_IDLE_CORES": mode})
    assert child_environment(idle)["GOMP_SPINCOUNT"] == "20000"
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    assert child_environment(idle)["GOMP_SPINCOUNT"] == "0"


def test_idle_cores_default_to_prefills_and_decodes_and_refuse_a_boolean():
    compute = load_settings(environ={}).compute
    assert (compute.idle_prefills, compute.idle_decodes) == (True, True)
    compute = load_settings(environ={"QUART_IDLE_CORES": "prefill"}).compute
    assert (compute.idle_prefills, compute.idle_decodes) == (True, False)
    compute = load_settings(environ={"QUART_IDLE_CORES": "off"}).compute
    assert (compute.idle_prefills, compute.idle_decodes) == (False, False)
    with pytest.raises(ConfigError, match="QUART_IDLE_CORES='true': must be one of off, prefill, all"):
        load_settings(environ={"QUART_IDLE_CORES": "true"})


@pytest.mark.parametrize("env,needle", [
    ({"QUART_REDIS_PORT": "seventy"}, "QUART_REDIS_PORT='seventy'"),
    ({"QUART_REDIS_PORT": "70000"}, "port number"),
    ({"QUART_TICK_S": "0"}, "QUART_TICK_S"),
    ({"QUART_FORK_COW": "maybe"}, "QUART_FORK_COW"),
    ({"QUART_POLICY_PARAMS": "{not json"}, "QUART_POLICY_PARAMS"),
    ({"QUART_POLICY_PARAMS": "[1, 2]"}, "not a JSON object"),
    ({"QUART_POLICY_PARAMS": '{"r_min": 2}'}, "QUART_R_MIN"),
    ({"QUART_R_MIN": "5", "QUART_R_MAX": "3"}, "above QUART_R_MAX"),
    ({"QUART_CACHE_MEMORY_THRESHOLD": "1.5"}, "(0, 1]"),
    ({"QUART_DEVICE": "tpu"}, "cpu, cuda"),
    ({"QUART_DTYPE": "int8"}, "float32"),
    ({"QUART_REPLICA_TTL_S": "1", "QUART_HEARTBEAT_S": "2"}, "QUART_HEARTBEAT_S"),
])
def test_bad_values_stop_with_the_variable_named(env, needle):
    with pytest.raises(ConfigError, match=None) as info:
        load_settings(environ=env)
    assert needle in str(info.value)


def test_unknown_names_in_a_file_or_an_override_are_refused(tmp_path):
    config = tmp_path / "quart.yml"
    config.write_text("redis_prot: 1\n")
    with pytest.raises(ConfigError, match="redis_prot"):
        load_settings(environ={"QUART_CONFIG": str(config)})
    with pytest.raises(ConfigError, match="nonsense"):
        load_settings(environ={}).replace(nonsense=1)


def test_identity_is_not_configuration():
    assert "model" not in load_settings(environ={}).flat()
    assert replica_identity({"QUART_MODEL": "m", "QUART_STAGES": "1-3"}) == ReplicaIdentity("m", "1-3", "cold")
    assert BY_NAME["stages"].section == "identity"


def test_one_bound_defaults_to_sixteen_and_clamps():
    b = load_settings(environ={}).autoscaler.bounds
    assert b == Bounds(1, 16) and b.clamp(0) == 1 and b.clamp(40) == 16
