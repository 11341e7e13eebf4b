"""The one-rank gloo group the rewrite passes' program tests run their collectives on."""

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()
