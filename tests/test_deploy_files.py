"""deploy/: every `ray up` file passes Ray's own cluster-config validation, and the role file loads."""

from __future__ import annotations

import copy
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


def test_roles_file_asks_for_resources_the_cloud_nodes_offer():
    resources, autoscale = load_deploy_file(str(DEPLOY / "roles.toml"))
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
