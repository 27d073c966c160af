"""Nothing cpattn starts listens beyond loopback by default (issue 23, points 5 and 6).

Real processes; their sockets are read from /proc (cpattn.comm.listeners).
"""

import os
import sys

import pytest
import torch

from cpattn.comm.launch import spawn
from cpattn.comm.listeners import listening, reachable_beyond_loopback

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def my_listeners(group):
    """After the group is up and a collective ran (every gloo pair connected): this rank's listening sockets."""
    group.all_reduce(torch.ones(2))
    mine = [os.getpid()]
    return [(str(x), x.loopback) for x in listening(mine)], [str(x) for x in reachable_beyond_loopback(mine)]


def test_a_local_spawn_listens_on_loopback_only():
    results = spawn(2, my_listeners, timeout_s=60)
    for rank, (listeners, exposed) in enumerate(results):
        assert exposed == [], f"rank {rank} listens beyond loopback: {exposed} (all: {listeners})"
