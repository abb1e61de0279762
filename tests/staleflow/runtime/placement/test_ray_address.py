"""A Ray address where nothing listens fails at once with the address and the fix,
instead of ``ray.init`` retrying for minutes. No Ray is started."""

from __future__ import annotations

import socket

import pytest

from staleflow.runtime.placement.ray_address import check_reachable, host_port


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("auto", None),
        ("local", None),
        ("10.0.0.5:6379", ("10.0.0.5", 6379)),
        ("ray://head.cluster:10001", ("head.cluster", 10001)),
        ("head.cluster", None),  # no port: left to Ray
    ],
)
def test_host_port(address, expected):
    assert host_port(address) == expected


def test_a_bad_port_is_named():
    with pytest.raises(ValueError, match="port is not a number"):
        host_port("head:http")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nothing_listening_is_a_clear_error():
    port = _closed_port()
    with pytest.raises(
        ConnectionError, match=rf"no Ray cluster answers at 127.0.0.1:{port}.*ray start --head"
    ):
        check_reachable(f"127.0.0.1:{port}", timeout_s=2.0)


def test_a_silent_address_is_given_up_after_the_timeout(monkeypatch):
    """A host that drops packets never refuses: the connect itself carries the bound (no
    retries after it), so the check ends within ``timeout_s`` rather than Ray's minutes."""
    asked = []

    def create_connection(address, timeout=None):
        asked.append((address, timeout))
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", create_connection)
    with pytest.raises(ConnectionError, match=r"no Ray cluster answers at 10.0.0.5:6379"):
        check_reachable("10.0.0.5:6379", timeout_s=2.0)
    assert asked == [(("10.0.0.5", 6379), 2.0)]


def test_a_listening_address_and_auto_pass():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_reachable(f"127.0.0.1:{server.getsockname()[1]}")
    check_reachable("auto")


def test_cli_status_and_launch_fail_fast_on_an_unreachable_address(capsys, tmp_path):
    pytest.importorskip("ray")
    from staleflow.cli import main

    address = f"127.0.0.1:{_closed_port()}"
    assert main(["status", "--address", address]) == 2
    assert f"no Ray cluster answers at {address}" in capsys.readouterr().err
    from staleflow.config import load_config
    from staleflow.runtime.driver.launch import LaunchError, Run
    from staleflow.runtime.driver.run_plan import plan_run
    from staleflow.runtime.driver.supervisor import Supervisor

    plan = plan_run(load_config(None, [f"address={address}", f"run_dir={tmp_path}"]))
    with pytest.raises(LaunchError, match="no Ray cluster answers"):
        Run(plan, tmp_path, supervisor=Supervisor).start(None, None, None)


def test_launch_refuses_an_unreachable_address_before_preparing_the_policy(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    from staleflow.config import load_config
    from staleflow.runtime.driver import launch as launching

    def never(*args, **kwargs):
        raise AssertionError("the policy was prepared (a warm-up) for a cluster nobody runs")

    monkeypatch.setattr(launching, "prepare_policy", never)
    address = f"127.0.0.1:{_closed_port()}"
    cfg = load_config(None, [f"address={address}", f"run_dir={tmp_path}"])
    with pytest.raises(launching.LaunchError, match=f"no Ray cluster answers at {address}"):
        launching.launch(cfg)
    assert not any(tmp_path.iterdir())
