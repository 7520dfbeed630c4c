"""Addresses and interfaces: what tells ranks on same-named hosts apart, and names a lost peer."""

from __future__ import annotations

from ddptrain.parallel import netinfo

ADDRS = ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]


def test_hosts_that_share_a_name_are_told_apart_by_address():
    assert netinfo.describe_hosts(["vm"] * 4, ADDRS) == "vm (10.0.0.1): ranks 0-1 · vm (10.0.0.2): ranks 2-3"
    assert netinfo.describe_hosts(["a", "b", "a"], ["1", "2", "1"]) == "a (1): ranks 0, 2 · b (2): rank 1"


def test_a_communication_error_names_the_lost_node_and_its_ranks():
    gloo = "[pair.cc:553] Connection closed by peer [10.0.0.2]:42634. This is typically caused by a remote worker"
    note = netinfo.lost_peers_note(gloo, ["a", "a", "b", "b"], ADDRS, own_addr="10.0.0.1")
    assert note == "; lost rank 2, 3 on host b (10.0.0.2): that node's processes died or its network failed"
    # The node's own address (on one machine: every rank's) says nothing; unknown addresses are ignored.
    assert netinfo.lost_peers_note(gloo.replace("10.0.0.2", "10.0.0.1"), ["a"] * 4, ADDRS, "10.0.0.1") == ""
    assert netinfo.lost_peers_note("reset by peer [10.9.9.9]:1 at 110.0.0.22", ["a"] * 4, ADDRS, "10.0.0.1") == ""


def test_the_configured_interface_wins_over_the_route():
    addresses = {"lo": "127.0.0.1", "eth0": "192.0.2.2", "ib0": "10.1.0.5"}
    pick = netinfo._configured_interface
    assert pick({"GLOO_SOCKET_IFNAME": "ib0,eth0"}, addresses) == "ib0"
    assert pick({"NCCL_SOCKET_IFNAME": "eth"}, addresses) == "eth0"  # NCCL: a prefix
    assert pick({"NCCL_SOCKET_IFNAME": "=eth"}, addresses) is None  # '=': exact name
    assert pick({"NCCL_SOCKET_IFNAME": "^lo,docker"}, addresses) is None  # exclusions: the route decides
    assert pick({}, addresses) is None


def test_this_process_has_an_address_on_a_real_interface():
    addr, interface = netinfo.job_address({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert (addr, interface) == ("127.0.0.1", "lo")
    assert netinfo.interface_addresses()["lo"] == "127.0.0.1"
