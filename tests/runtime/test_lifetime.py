"""A parallelized model lets go of its memory as soon as it is dropped: its parameters' gradient
hooks hold it weakly (runtime.grad_sync.weak_hook). Held strongly, the hooks closed a cycle that
Python's collector cannot see while autograd also holds the parameters, and a training loop
that built a second model on a GPU ran out of memory (benchmarks/gpu.py on one H100)."""

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from equivalence import load_example

import autopar


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("precision, microbatches", [("fp32", 1), ("bf16-mixed", 2)])
def test_a_dropped_model_is_freed_at_once(one_rank, precision, microbatches):
    torch.manual_seed(0)
    model = load_example("gpt.py").build(hidden=32, layers=1, heads=2, vocab=64, seq=8)
    inputs = model.example_inputs(2)
    options = dict(precision=precision, microbatches=microbatches, recompute="none", zero=0)
    parallel = autopar.parallelize(model, "1", inputs, **options)
    optimizer = parallel.optimizer(torch.optim.AdamW, lr=1e-3)
    parallel.train_step(*inputs)
    optimizer.step()
    dropped, weight = weakref.ref(parallel), weakref.ref(next(parallel.parameters()))
    gc.disable()  # no collection: reference counting alone must free them
    try:
        del parallel, optimizer
        assert dropped() is None and weight() is None
    finally:
        gc.enable()
