"""The local Redis Cluster that the tests and the benchmark start (fngate.tools.local_cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fngate.tools import local_cluster
from fngate.tools.local_cluster import LocalCluster


@pytest.mark.cluster
def test_a_local_clusters_ports_are_below_the_ephemeral_range(redis_cluster: LocalCluster) -> None:
    """A node killed by a test is restarted on its ports: no connection of another process may have
    taken one of them meanwhile, as one may take any port of the kernel's ephemeral range."""
    low, _high = local_cluster.ephemeral_ports()
    for port in redis_cluster.ports:
        assert port + local_cluster.BUS_OFFSET < low, (port, low)


def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path: Path) -> None:
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t60999\n")
    assert local_cluster.ephemeral_ports(str(ranges)) == (40000, 60999)
    ranges.write_text("16000\t60999\n")  # too little room below it: the default's is kept clear
    assert local_cluster.ephemeral_ports(str(ranges)) == local_cluster.EPHEMERAL_DEFAULT
    assert local_cluster.ephemeral_ports(str(tmp_path / "absent")) == local_cluster.EPHEMERAL_DEFAULT
