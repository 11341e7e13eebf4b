"""Helpers for one-process planner tests: meta-device models from examples/."""

import torch
from equivalence import load_example

import autopar


def meta_model(file: str, builder: str = "build", **kwargs):
    with torch.device("meta"):
        return getattr(load_example(file), builder)(**kwargs)


def plan_example(file: str, mesh, batch: int, builder: str = "build", model_kwargs=None, **options):
    model = meta_model(file, builder, **(model_kwargs or {}))
    return autopar.plan(model, mesh, model.example_inputs(batch, device="meta"), **options)
