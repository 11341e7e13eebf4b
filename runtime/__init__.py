"""What a parallelized program runs on: launch, process groups, collectives, gradient sync,
and the module that ties them together (``module.ParallelModule``).

Importing this package registers the ``autopar::`` collective ops that rewritten graphs call.
"""

from .collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    chunk,
    grad_all_reduce,
    keep_on_first,
    reduce_scatter,
)
from .checkpoint import load_checkpoint, save_checkpoint
from .grad_sync import GradSync
from .zero3 import zero_gather
from .zigzag import zigzag
from .context_parallel import ring_attention, ulysses_attention
from .expert_parallel import moe
from .launch import free_port, init_from_env, launch_local
from .process_groups import build_device_mesh, group_name
from .spawn import run_local
