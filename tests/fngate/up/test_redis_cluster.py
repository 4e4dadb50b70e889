"""The local Redis Cluster that the tests and the benchmark start (fngate.up.redis_cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fngate.up.redis_cluster import BUS_OFFSET, EPHEMERAL_DEFAULT, LocalCluster, ephemeral_ports


@pytest.mark.cluster
def test_a_local_clusters_ports_are_below_the_ephemeral_range(redis_cluster: LocalCluster) -> None:
    """A node killed by a test is restarted on its ports: no connection of another process may have
    taken one of them meanwhile, as one may take any port of the kernel's ephemeral range."""
    low, _high = ephemeral_ports()
    for port in redis_cluster.ports:
        assert port + BUS_OFFSET < low, (port, low)


def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path: Path) -> None:
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t60999\n")
    assert ephemeral_ports(str(ranges)) == (40000, 60999)
    ranges.write_text("16000\t60999\n")  # too little room below it: the default's is kept clear
    assert ephemeral_ports(str(ranges)) == EPHEMERAL_DEFAULT
    assert ephemeral_ports(str(tmp_path / "absent")) == EPHEMERAL_DEFAULT
