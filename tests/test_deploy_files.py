"""deploy/: every `ray up` file passes Ray's own cluster-config validation, is safe by default
(dashboard not on the network, token authentication on), and each has a roles file whose
resources its nodes offer."""

from __future__ import annotations

import copy
import ipaddress
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from epd.config import ROLES, ConfigError, load_deploy_file

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
CLUSTER_FILES = sorted(DEPLOY.glob("*.yaml"))


def _validate(config: dict) -> None:
    validate_config(prepare_config(copy.deepcopy(config)))  # what `ray up` runs before launching


def test_there_are_an_on_premises_and_a_cloud_file():
    providers = {yaml.safe_load(path.read_text())["provider"]["type"] for path in CLUSTER_FILES}
    assert {"local", "aws"} <= providers


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_cluster_file_passes_ray_validation(path):
    _validate(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_validation_catches_a_misspelled_field(path):
    config = yaml.safe_load(path.read_text())
    config["idle_timeout_minutez"] = 5
    with pytest.raises(jsonschema.ValidationError):
        _validate(config)


def test_cloud_file_has_a_separate_encoder_node_type():
    config = yaml.safe_load((DEPLOY / "aws.yaml").read_text())
    types = config["available_node_types"]
    encoder_types = [name for name, t in types.items() if "epd_encoder" in t.get("resources", {})]
    lm_types = [name for name, t in types.items() if "epd_lm" in t.get("resources", {})]
    assert encoder_types and lm_types and not set(encoder_types) & set(lm_types)


# Which roles file goes with which cluster file (docs/DEPLOY.md says the same).
ROLES_FOR = {"aws.yaml": "roles.toml", "onprem.yaml": "roles-onprem.toml"}


def _commands(config: dict) -> list[str]:
    """Every shell command of a cluster file, per-node-type ones included."""
    keys = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
            "head_start_ray_commands", "worker_start_ray_commands")
    found = [c for key in keys for c in config.get(key) or []]
    for node_type in (config.get("available_node_types") or {}).values():
        found += [c for key in keys for c in node_type.get(key) or []]
    return found


def _dashboard_exposed(config: dict) -> list[str]:
    """The --dashboard-host values that open the dashboard beyond the head itself (Ray's default,
    without the flag, is 127.0.0.1). The head's own private address is allowed."""
    allowed = {"localhost", str(config.get("provider", {}).get("head_ip", "127.0.0.1"))}
    exposed = []
    for command in _commands(config):
        for host in re.findall(r"--dashboard-host[= ]+['\"]?([^\s'\"]+)", command):
            try:
                loopback = ipaddress.ip_address(host).is_loopback
            except ValueError:
                loopback = False
            if not loopback and host not in allowed:
                exposed.append(host)
    return exposed


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_no_cluster_file_opens_the_dashboard_to_the_network(path):
    config = yaml.safe_load(path.read_text())
    assert _dashboard_exposed(config) == [], f"{path.name} binds the Ray dashboard (and its job API) to the network"


@pytest.mark.parametrize("flag", ["--dashboard-host=0.0.0.0", "--dashboard-host 0.0.0.0", "--dashboard-host='::'",
                                  "--dashboard-host=10.9.9.9"])
def test_the_dashboard_check_catches_an_open_dashboard(flag):
    config = yaml.safe_load((DEPLOY / "onprem.yaml").read_text())
    config["head_start_ray_commands"][-1] += " " + flag
    assert _dashboard_exposed(config)


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_token_authentication_stays_on(path):
    """Every node starts Ray in token mode, with the workstation's token copied to it."""
    config = yaml.safe_load(path.read_text())
    assert config["file_mounts"].get("~/.ray/auth_token") == "~/.ray/auth_token", path.name
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in config[key] if "ray start" in c]
        assert starts and all("RAY_AUTH_MODE=token" in c for c in starts), (path.name, key)
    assert not any("RAY_AUTH_MODE=disabled" in c for c in _commands(config)), path.name


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_setup_installs_only_what_is_missing_and_puts_ray_on_path(path):
    """Setup steps must pass on nodes already set up (a second `ray up`, machines without an
    index); `ray down` runs a bare `ray stop`, which must find the venv's ray."""
    config = yaml.safe_load(path.read_text())
    for command in config["setup_commands"]:
        assert "||" in command, f"{path.name}: setup step runs unconditionally: {command}"
    assert any("export PATH=/opt/epd/venv/bin:" in c and ".bashrc" in c for c in config["setup_commands"]), path.name


def test_onprem_head_runs_autoscaler_v1():
    """With the local provider, autoscaler v2 (what `ray up` turns on since Ray 2.50) never starts
    a worker; the head's start command turns it off after `ray up`'s own export."""
    config = yaml.safe_load((DEPLOY / "onprem.yaml").read_text())
    start = next(c for c in config["head_start_ray_commands"] if "ray start" in c)
    assert "RAY_enable_autoscaler_v2=0" in start
    assert start.index("RAY_enable_autoscaler_v2=0") < start.index("ray start")


def _start_resources(command: str) -> dict:
    match = re.search(r"--resources[= ]+'([^']*)'", command)
    return json.loads(match.group(1)) if match else {}


def test_onprem_roles_file_asks_for_what_the_onprem_nodes_offer():
    """deploy/roles-onprem.toml against deploy/onprem.yaml's start commands: every role fits on
    a node, the routers on the head, everything else on the workers."""
    config = yaml.safe_load((DEPLOY / "onprem.yaml").read_text())
    offer = {kind: _start_resources(next(c for c in config[f"{kind}_start_ray_commands"] if "ray start" in c))
             for kind in ("head", "worker")}
    resources, autoscale = load_deploy_file(str(DEPLOY / ROLES_FOR["onprem.yaml"]))
    assert set(resources) == set(ROLES)
    fits = {role: [kind for kind, offered in offer.items()
                   if res.resources and all(offered.get(name, 0) >= amount for name, amount in res.resources.items())
                   and res.num_gpus == 0]
            for role, res in resources.items()}
    assert fits == {role: ["head"] if role == "router" else ["worker"] for role in ROLES}, fits
    assert not autoscale.enabled


@pytest.mark.parametrize("cluster", sorted(ROLES_FOR))
def test_each_cluster_file_names_its_roles_file(cluster):
    assert ROLES_FOR[cluster] in (DEPLOY / cluster).read_text(), f"{cluster} should say which roles file goes with it"


def test_roles_file_asks_for_resources_the_cloud_nodes_offer():
    resources, autoscale = load_deploy_file(str(DEPLOY / ROLES_FOR["aws.yaml"]))
    assert set(resources) == set(ROLES)
    offered = set()
    for node_type in yaml.safe_load((DEPLOY / "aws.yaml").read_text())["available_node_types"].values():
        offered |= set(node_type.get("resources", {}))
    for role, res in resources.items():
        assert set(res.resources) <= offered, role
    assert autoscale.enabled and autoscale.min_replicas <= autoscale.max_replicas


@pytest.mark.parametrize("text,message", [
    ("[roles.encodr]\nnum_cpus = 1\n", "unknown role 'encodr'"),
    ("[roles.encoder]\nnum_cpu = 1\n", "roles.encoder: unknown keys ['num_cpu']"),
    ("[roles.encoder]\nresources = { epd = -1 }\n", "resources.epd: must be in (0, 1048576]"),
    ("[autoscale]\nmin_replicas = 4\nmax_replicas = 2\n", "autoscale.max_replicas: must be in [min_replicas=4, 256]"),
    ("[autoscal]\n", "unknown tables ['autoscal']"),
])
def test_bad_role_file_names_the_field(tmp_path, text, message):
    path = tmp_path / "roles.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
        load_deploy_file(str(path))
