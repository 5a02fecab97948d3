import ipaddress
import logging
import os
import sys

# No network at test time beyond the loopback address: the Hugging Face Hub offline (inherited by the processes tests
# start): bitsandbytes' CPU backend asks the Hub for a kernel when it is imported on a CPU with AVX512-BF16; and
# every name lookup or connection this process makes to another host is recorded, failing the test that made it
os.environ["HF_HUB_OFFLINE"] = "1"
_network_calls: list[str] = []


def _is_local(host) -> bool:
    if host is None or host in ("", "localhost", b"", b"localhost"):
        return True
    try:
        return ipaddress.ip_address(host.decode() if isinstance(host, bytes) else host).is_loopback
    except ValueError:
        return False


def _record_network(event: str, args: tuple) -> None:
    if event == "socket.getaddrinfo":  # args: host, port, ...
        host, where = args[0], args[:2]
    elif event == "socket.connect" and isinstance(args[1], tuple):  # args: socket, (host, port, ...)
        host, where = args[1][0], args[1]
    else:
        return
    if not _is_local(host):
        _network_calls.append(f"{event}{where}")


sys.addaudithook(_record_network)

import pytest  # noqa: E402
import torch  # noqa: E402

# One thread, in process and in the processes tests start (OMP_NUM_THREADS is inherited): the tests' matrices are
# tiny, and spin-waiting OpenMP threads on a shared 2-core CPU make them many times slower (the demo's steps ~10x)
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True)
def _quiet_logs():
    logging.getLogger("longrl").setLevel(logging.WARNING)
    yield


@pytest.fixture(autouse=True)
def _no_network():
    """Fails the test that looked up or connected to a host other than the loopback address."""
    before = len(_network_calls)
    yield
    assert len(_network_calls) == before, f"network access at test time: {_network_calls[before:]}"
