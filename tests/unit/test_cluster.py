"""The emulated cluster's config validation, names, addresses and refusals, anywhere, touching
nothing on the system. The cluster brought up for real: tests/e2e/test_cluster_e2e.py."""

from __future__ import annotations

import ipaddress

import pytest

from gradsync.cluster import Cluster, parse_rate
from gradsync.cluster import system as cluster_system
from gradsync.cluster.system import requirements_missing
from gradsync.errors import UsageError

pytestmark = pytest.mark.unit


# -- pure logic ----------------------------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("text", "bps"),
    [("100mbit", 10**8), ("1gbit", 10**9), ("1.5Gbit", 15 * 10**8), ("512kbit", 512_000)],
)
def test_parse_rate(text: str, bps: int) -> None:
    assert parse_rate(text) == bps


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"hosts": 0},
        {"hosts": 251},
        {"link": "100mbps"},  # tc reads mbps as megabytes: refuse the ambiguity
        {"link": "fast"},
        {"link": "1bit"},
        {"burst": "100b"},  # below one frame: tbf would drop every full-size packet
        {"burst": "lots"},
        {"prefix": "eth0"},  # no trailing dash: could collide with real interface names
        {"prefix": "toolong-"},
        {"name": "ABCD"},
        {"name": "abcde"},
    ],
)
def test_cluster_config_rejects(kwargs: dict[str, object]) -> None:
    with pytest.raises(UsageError):
        Cluster(**kwargs)  # type: ignore[arg-type]


@pytest.mark.timeout(10)
def test_names_fit_and_addresses_are_private() -> None:
    c = Cluster(hosts=250, link="1gbit", prefix="abcde-", name="wxyz")
    names = [c.bridge, c.switch_ns] + [c.switch_port(i) for i in range(c.hosts)]
    names += [n for h in c.host_list for n in (h.netns, h.ifname)]
    assert max(len(n) for n in names) <= 15  # IFNAMSIZ - 1
    assert all(n.startswith("abcde-wxyz-") for n in names)
    addrs = [ipaddress.ip_address(h.addr) for h in c.host_list]
    assert len(set(addrs)) == c.hosts
    assert all(a in ipaddress.ip_network("10.213.0.0/24") and a.is_private for a in addrs)
    assert Cluster(link="100mbit").burst_bytes == 16 * 1024  # default floor
    assert Cluster(link="10gbit").burst_bytes == 10**10 // 8 // 1000  # 1 ms of the link


@pytest.mark.timeout(10)
def test_requirements_message_names_root(monkeypatch: pytest.MonkeyPatch) -> None:
    requirements_missing.cache_clear()
    monkeypatch.setattr(cluster_system.os, "geteuid", lambda: 1000)
    try:
        assert "root" in (requirements_missing() or "")
    finally:
        monkeypatch.undo()
        requirements_missing.cache_clear()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["probe", "--size-mb", "0"], "need --size-mb > 0, --iters >= 1 and --warmup >= 0"),
        (["probe", "--iters", "0"], "need --size-mb > 0"),
        (["probe", "--hosts", "1"], "an all-reduce needs 2 ranks"),
        (["up", "--link", "fast"], "bad link rate 'fast'"),
        (["up", "--name", "ABCD"], "bad cluster name 'ABCD'"),
        (["up", "--hosts", "0"], "--hosts must be 1 to 250, got 0"),
        (["probe", "--prefix", "eth0", "--hosts", "2"], "bad prefix 'eth0'"),
    ],
)
def test_cli_refuses_bad_flags_before_touching_the_system(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The flags (ProbeOptions, UpOptions...) reach Cluster's checks: exit 2, one line."""
    from gradsync.runner.cli import main

    assert main(["cluster", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradsync: error: ") and message in err
    assert len(err.strip().splitlines()) == 1
