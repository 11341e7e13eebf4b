"""Helpers for one-process planner tests: meta-device models from examples/."""

import dataclasses

import torch
from equivalence import load_example

import autopar
from autopar.ir import get_profile


def meta_model(file: str, builder: str = "build", **kwargs):
    with torch.device("meta"):
        return getattr(load_example(file), builder)(**kwargs)


def plan_example(file: str, mesh, batch: int, builder: str = "build", model_kwargs=None, **options):
    model = meta_model(file, builder, **(model_kwargs or {}))
    return autopar.plan(model, mesh, model.example_inputs(batch, device="meta"), **options)


def slow_network(factor: float = 1000) -> autopar.ir.HardwareProfile:
    """The A100 preset with its nodes joined by a network ``factor`` times slower: tensor and data
    parallelism across nodes then move more than a pipeline's stage boundaries."""
    a100 = get_profile("a100-80gb")
    slow = dataclasses.replace(a100.links[1], bandwidth=a100.links[1].bandwidth / factor)
    return dataclasses.replace(a100, name="a100-slow-network", links=(a100.links[0], slow))
