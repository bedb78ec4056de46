"""`epd status`'s text: a role's header is its state now, the life events since the controller
started are history, apart and labelled (issue 21: `router: 1 of 1 (1 unhealthy)` stayed forever
after a blip the router had recovered from)."""

from __future__ import annotations

import time

from control.cli import _print_status


def _replica(name: str, state: str, draining: bool = False) -> dict:
    return {"name": name, "address": "127.0.0.1:5000", "node_id": "n", "node_ip": "127.0.0.1", "pid": 1,
            "http_address": "", "draining": draining, "healthy": state == "serving", "in_flight": 0, "state": state}


def _status(roles: dict, counts: dict, events: list, desired: dict | None = None, failed: str = "") -> dict:
    kinds = ("died", "restarted", "replaced", "unhealthy", "recovered")
    return {"namespace": "epd", "time": time.time(), "roles": roles,
            "desired": desired or {role: len(replicas) for role, replicas in roles.items()},
            "metrics": "127.0.0.1:9000", "events": events, "unplaced": [], "failed": failed,
            "counts": {role: {kind: counts.get(role, {}).get(kind, 0) for kind in kinds} for role in roles}}


def _event(name: str, kind: str, seconds: float = 0.0) -> dict:
    return {"time": time.time(), "role": name.rsplit("-", 1)[0], "name": name, "kind": kind, "seconds": seconds,
            "detail": ""}


def _lines(status: dict, capsys) -> list[str]:
    _print_status(status, header=False)
    return capsys.readouterr().out.splitlines()


def test_a_recovered_blip_is_history_not_the_state_now(capsys):
    status = _status({"router": [_replica("router-4", "serving")], "decode": [_replica("decode-3", "serving")]},
                     {"router": {"unhealthy": 1, "recovered": 1}},
                     [_event("router-4", "joined", 2.0), _event("router-4", "unhealthy"),
                      _event("router-4", "recovered", 1.5)])
    lines = _lines(status, capsys)
    assert "router: 1 of 1 serving" in lines, lines
    assert "decode: 1 of 1 serving" in lines, lines
    history = [line for line in lines if line.startswith("history")]
    assert len(history) == 1 and "router 1 unhealthy, 1 recovered" in history[0], lines
    assert "not the state now" in history[0]
    assert not any(line.startswith("router:") and "unhealthy" in line for line in lines), lines
    assert any("router-4 recovered (1.5 s)" in line for line in lines), lines


def test_the_header_says_what_is_wrong_now(capsys):
    status = _status({"prefill": [_replica("prefill-1", "unreachable"), _replica("prefill-2", "serving"),
                                  _replica("prefill-5", "starting")],
                      "router": [_replica("router-4", "serving", draining=True), _replica("router-6", "not_serving")]},
                     {}, [], desired={"prefill": 3, "router": 2})
    lines = _lines(status, capsys)
    assert "prefill: 1 of 3 serving, 1 starting, 1 not answering" in lines, lines
    assert "router: 0 of 2 serving, 1 draining, 1 not serving" in lines, lines
    assert not any(line.startswith("history") for line in lines), lines  # nothing happened yet


def test_a_deployment_that_stopped_itself_says_why_first(capsys):
    status = _status({"router": []}, {}, [], desired={"router": 1},
                     failed="router replicas failed to start 3 times in a row, last: ValueError: no config.json")
    lines = _lines(status, capsys)
    assert lines[0] == ("deployment stopped: router replicas failed to start 3 times in a row, last: ValueError: "
                        "no config.json"), lines
    assert "router: 0 of 1 serving" in lines, lines


def test_a_role_that_starts_no_more_replicas_says_why(capsys):
    status = _status({"prefill": [_replica("prefill-2", "serving")]}, {}, [], desired={"prefill": 2})
    status["not_replacing"] = {"prefill": "prefill replicas failed to start 3 times in a row, last: OSError: x"}
    lines = _lines(status, capsys)
    assert "prefill: 1 of 2 serving" in lines, lines
    assert ("prefill: not starting more replicas: prefill replicas failed to start 3 times in a row, last: "
            "OSError: x (`epd scale` tries again)") in lines, lines


def test_a_decode_replica_shows_its_kv_pool(capsys):
    decode = _replica("decode-3", "serving")
    decode["kv"] = {"blocks_used": 512, "blocks": 2048, "usage": 0.25, "capacity_tokens": 32768, "preemptions": 3,
                    "swapped_bytes": 0}
    lines = _lines(_status({"decode": [decode]}, {}, []), capsys)
    assert any("decode-3" in line and "K/V 25% of 32768 tokens, 3 preempted" in line for line in lines)


def test_the_history_says_since_when_and_counts_controller_restarts(capsys):
    status = _status({"router": [_replica("router-4", "serving")]}, {"router": {"restarted": 1}},
                     [_event("router-4", "restarted", 4.0), _event("controller", "restarted")])
    status["since"] = time.mktime((2026, 12, 1, 9, 30, 5, 0, 0, -1))
    status["controller_starts"] = 3
    lines = _lines(status, capsys)
    history = [line for line in lines if line.startswith("history")]
    assert history == ["history (since the deployment started at 09:30:05, not the state now): router 1 restarted; "
                       "controller restarted 2x"], lines
    assert any(line.endswith("controller restarted") for line in lines), lines
