"""``autopar verify``: run a plan on local gloo ranks against one process; say how far apart they are.

One training step both ways from the same seeded weights on the model's example inputs (forward,
backward, one AdamW step): on local gloo processes running the plan, and in each of them as the
plain model. The :class:`Report` holds the worst relative error of the loss, of every gradient and
of every updated parameter; the plan is exact when each is at most :data:`RTOL` (fp32, the
tolerance of the equivalence tests).

What runs (:func:`prepare`):

- the plan as it is, when the model and its mesh fit here (``max_ranks`` local ranks, the
  estimated memory within ``memory_budget``);
- a smaller copy with the same placement pattern and smaller degrees when the model does not fit
  (:mod:`autopar.shrink` says how it is derived).

Every run has a time limit: ranks still running after ``timeout_s`` are killed and reported.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tabulate import tabulate

from autopar.api import capture, parallelize
from autopar.api import plan as make_plan
from autopar.ir import ConfigError, Mesh, Plan, PlanOptions, Replicate, StalePlanError, batch_split
from autopar.passes.rewrite.rewrite import check_plan
from autopar.runtime.spawn import run_local
from autopar.shrink import SIZES, pattern_batch, pattern_options, shrink

RTOL, ATOL = 1e-4, 1e-6  # fp32; an element near zero is judged by ATOL (the equivalence tests use these too)
# Adam's first step moves each element by lr * g / (|g| + eps): fp32 rounding in a gradient
# element near 1e-7 (seen: 1e-8 absolute, i.e. 2e-7 of the largest gradient) shifts that
# element's update by ~1% of lr. At lr=1e-4 that is ~1e-6, 20x under the 1e-4 tolerance on
# parameters of scale 0.05, while a mis-sharded or missing update (~lr) is 20x over it.
# Near |g| ≈ eps the update's slope is lr/(4·eps): with the default eps=1e-8, 1e-9 of rounding
# noise moves an element by 2.5e-6. eps=1e-6 (a common AdamW setting) keeps that at 2.5e-8.
LEARNING_RATE, ADAM_EPS = 1e-4, 1e-6
BATCH_PER_DEVICE = 2
SHRINK_CHOICES = ("auto", "always", "never")


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """Worst elementwise ``|value - reference| / (|reference| + ATOL / RTOL)``: the relative error,
    floored so that elements near zero are judged by ATOL. At most RTOL means ``allclose`` holds.

    >>> relative_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0002]))   # doctest: +SKIP
    9.99e-05
    """
    value, reference = value.detach().double(), reference.detach().double()
    return ((value - reference).abs() / (reference.abs() + ATOL / RTOL)).max().item()


@dataclass(frozen=True)
class Target:
    """What the ranks run: ``factory(*args, **kwargs)`` (seed 0) on ``mesh`` with ``plan`` as it is,
    or planned with ``options``; ``notes`` say how it differs from what was asked."""

    factory: Callable
    args: tuple
    kwargs: dict
    mesh: Mesh
    batch: int
    plan: Plan | None = None
    options: PlanOptions | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Report:
    """Worst relative errors of one step: the loss, and by parameter name the gradient and the
    parameter after AdamW (the largest over ranks); or the ``error`` that stopped the run."""

    target: Target
    degrees: dict
    split: dict = dataclasses.field(default_factory=dict)  # axis -> {"params": n, "inputs": n} split over it
    loss: float = math.inf
    grads: dict = dataclasses.field(default_factory=dict)
    params: dict = dataclasses.field(default_factory=dict)
    error: str | None = None

    @property
    def worst(self) -> tuple[str, float]:
        """What is furthest off, and by how much."""
        errors = [("loss", self.loss)]
        errors += [(f"gradient of {name}", e) for name, e in self.grads.items()]
        errors += [(f"updated {name}", e) for name, e in self.params.items()]
        return max(errors, key=lambda item: item[1])

    @property
    def exact(self) -> bool:
        return self.error is None and self.worst[1] <= RTOL

    def text(self) -> str:
        target = self.target
        lines = [
            f"verified on {target.mesh.size} local gloo rank(s) against one process: degrees "
            f"{' x '.join(f'{a}={s}' for a, s in self.degrees.items()) or '?'}, global batch {target.batch}, "
            "one step (forward, backward, AdamW)",
            *(f"note: {note}" for note in target.notes),
        ]
        if not self.error:
            split = "; ".join(
                f"{axis}: {n['params']} parameters, {n['inputs']} inputs" for axis, n in self.split.items()
            )
            lines.append(f"split: {split or 'nothing'} (of {len(self.params)} parameters on the ranks' stages)")
        if self.error:
            return "\n".join([*lines, f"error: {self.error}"])
        rows = [[name, _e(self.grads.get(name)), _e(self.params.get(name))] for name in sorted(self.params)]
        table = tabulate(rows, headers=["parameter", "gradient", "after AdamW"], disable_numparse=True)
        what, error = self.worst
        verdict = "exact" if self.exact else "NOT exact"
        return "\n".join(
            [
                *lines,
                f"relative error of the loss: {_e(self.loss)}",
                table,
                f"worst: {what}, relative error {_e(error)} ({'<=' if self.exact else '>'} {RTOL:g}): {verdict}",
            ]
        )

    def to_json(self) -> dict:
        what, error = self.worst
        return {
            "mesh": list(self.target.mesh.shape),
            "degrees": self.degrees,
            "split": self.split,
            "batch": self.target.batch,
            "notes": list(self.target.notes),
            "loss": self.loss,
            "grads": self.grads,
            "params": self.params,
            "worst": {"what": what, "relative_error": error},
            "tolerance": RTOL,
            "exact": self.exact,
            "error": self.error,
        }


def split_counts(plan: Plan) -> dict[str, dict[str, int]]:
    """Per axis, how many parameters and inputs the plan splits over it (so that an exact report
    is seen not to be a vacuous one)."""
    return {
        axis: {
            "params": sum(1 for p in plan.params.values() if p[i] != Replicate()),
            "inputs": sum(1 for p in plan.inputs.values() if p[i] != Replicate()),
        }
        for i, axis in enumerate(plan.degrees)
        if plan.degrees[axis] > 1
    }


def _e(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def prepare(
    factory: Callable,
    mesh,
    *,
    args: tuple = (),
    kwargs: dict | None = None,
    plan: Plan | None = None,
    options: PlanOptions | None = None,
    batch: int | None = None,
    max_ranks: int = 4,
    memory_budget: float | None = None,
    shrink_model: str = "auto",
) -> Target:
    """Decide what :func:`run` runs for ``factory(*args, **kwargs)`` on ``mesh`` (module docstring).

    ``factory`` must be picklable (a module-level function, or ``autopar.cli.models.Factory``):
    every rank builds the model itself. ``shrink_model``: "auto" (when it does not fit), "always",
    "never" (then a model that does not fit is an error).

    >>> target = prepare(build, "2x4", kwargs={"hidden": 4096, "layers": 32})   # doctest: +SKIP
    """
    if shrink_model not in SHRINK_CHOICES:
        raise ConfigError(f"shrink_model={shrink_model!r}: choose one of {SHRINK_CHOICES}")
    mesh, kwargs = Mesh.of(mesh), dict(kwargs or {})
    with torch.device("meta"):
        model = factory(*args, **kwargs)
    if not callable(getattr(model, "example_inputs", None)):
        raise ConfigError(
            f"verify runs the model on its example_inputs(batch_size, device=None), and the {type(model).__name__} "
            "the factory builds has none: wrap it in a module that has one (as examples/hf.py's CausalLM does)"
        )
    if plan is None:
        batch = batch or BATCH_PER_DEVICE * mesh.size
        options = PlanOptions.of(options, precision="fp32")
        captured = capture(model, model.example_inputs(batch, device="meta"))
        pattern = make_plan(captured, mesh, options=options)
    else:
        _check_plan_fits_request(plan, mesh, batch, options)
        batch, pattern = plan.batch_size, plan
        captured = capture(model, model.example_inputs(batch, device="meta"))
        _check_same_model(plan, model, captured.fingerprint)
    need = footprint(model, pattern)
    budget = memory_budget or available_memory() / 2
    fits = mesh.size <= max_ranks and need <= budget
    if shrink_model == "always" or (not fits and shrink_model == "auto"):
        return _shrunk(factory, args, kwargs, pattern, max_ranks, need, budget)
    if not fits:
        raise ConfigError(
            f"the model on mesh {mesh} needs {mesh.size} ranks and about {need / 2**30:.1f} GiB here; the limits are "
            f"{max_ranks} ranks and {budget / 2**30:.1f} GiB: allow a smaller copy (shrink) or raise the limits"
        )
    if plan is None:
        return Target(factory, args, kwargs, mesh, batch, options=options)
    return _runnable_plan(factory, args, kwargs, mesh, plan)


def _check_plan_fits_request(plan: Plan, mesh: Mesh, batch: int | None, options: PlanOptions | None) -> None:
    if options is not None and options != PlanOptions():
        raise ConfigError("a plan fixes every planning option: pass the plan or options, not both")
    if mesh.shape != plan.mesh.shape:
        raise ConfigError(f"the plan is for mesh {plan.mesh}, not {mesh}: pass --mesh {plan.mesh}")
    if batch is not None and batch != plan.batch_size:
        raise ConfigError(f"the plan is for a global batch of {plan.batch_size}, not {batch}: drop the batch")


def _check_same_model(plan: Plan, model: torch.nn.Module, fingerprint: str) -> None:
    names = {name for name, _ in model.named_parameters()}
    if plan.fingerprint != fingerprint and set(plan.params) != names:
        raise StalePlanError(
            f"the plan was made for another model: it places {len(plan.params)} parameters, "
            f"{len(set(plan.params) - names)} of which this model lacks (e.g. {sorted(set(plan.params) - names)[:2]}): "
            "plan this model (autopar plan MODEL --save) and verify that plan"
        )


def _runnable_plan(factory, args, kwargs, mesh: Mesh, plan: Plan) -> Target:
    """The plan as it is, checked against the CPU model's graph (a model on the meta device
    captures as its CPU twin, so a plan ``autopar plan --save`` made runs as it is)."""
    torch.manual_seed(0)
    model = factory(*args, **kwargs)
    captured = capture(model, model.example_inputs(plan.batch_size))
    if plan.fingerprint != captured.fingerprint:
        raise StalePlanError(
            f"the plan was made for graph {plan.fingerprint}, but this model captures as {captured.fingerprint}: "
            "it is a plan for other input shapes or another version of the model; re-plan it"
        )
    check_plan(captured, plan)  # a placement the model cannot take fails here, before any rank starts
    notes = () if plan.precision == "fp32" else (f"the plan trains in {plan.precision}; verified in fp32",)
    return Target(
        factory, args, kwargs, mesh, plan.batch_size, plan=dataclasses.replace(plan, precision="fp32"), notes=notes
    )


def _shrunk(factory, args, kwargs, pattern: Plan, max_ranks: int, need: float, budget: float) -> Target:
    try:
        copy = shrink(factory, kwargs, pattern, max_ranks)
    except ValueError as error:
        raise ConfigError(
            f"the model on mesh {pattern.mesh} needs about {need / 2**30:.1f} GiB and {pattern.mesh.size} ranks "
            f"(here: {budget / 2**30:.1f} GiB, {max_ranks} ranks), and {error}: pass smaller sizes or a smaller mesh"
        ) from None
    with torch.device("meta"):
        small = factory(*args, **copy.kwargs)
    world = math.prod(copy.degrees.values())
    small_need = world * 4 * sum(p.numel() * p.element_size() for p in small.parameters())
    if small_need > budget:
        raise ConfigError(
            f"even the smaller copy ({', '.join(copy.changes)}) needs about {small_need / 2**30:.1f} GiB here, more "
            f"than {budget / 2**30:.1f} GiB: its factory fixes sizes verify cannot lower (it lowers "
            f"{', '.join(SIZES)}); verify a factory that takes them"
        )
    params = {name for name, _ in small.named_parameters()}
    options = pattern_options(pattern, copy.degrees, params=params, modules=_modules(small))
    notes = (
        f"a smaller copy ({', '.join(copy.changes) or 'same sizes'}) with the plan's parameter placements, "
        "kernels and schedule pinned",
    )
    return Target(factory, args, copy.kwargs, Mesh((world,)), pattern_batch(options), options=options, notes=notes)


def _modules(model: torch.nn.Module) -> set[str]:
    return {name for name, _ in model.named_modules()}


def footprint(model: torch.nn.Module, plan: Plan) -> float:
    """Bytes a verify run takes here, roughly: every rank holds the whole model with its gradient
    and AdamW state and the whole batch's activations (the reference), plus its share of the plan."""
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    activations = plan.cost.memory.get("activations", 0.0) * batch_split(plan.degrees)
    return plan.mesh.size * (4 * param_bytes + activations + plan.cost.peak_memory)


def available_memory() -> float:
    """Bytes of memory this machine has free now."""
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def run(targets: list[Target], timeout_s: float = 600) -> list[Report]:
    """Run each target's step on its ranks (one spawn for all: they must share the rank count)."""
    worlds = {target.mesh.size for target in targets}
    if len(worlds) != 1:
        raise ConfigError(f"targets run together must have one rank count, got {sorted(worlds)}")
    per_rank = run_local(_rank_steps, worlds.pop(), targets, timeout_s=timeout_s)
    return [_merge(target, [steps[i] for steps in per_rank]) for i, target in enumerate(targets)]


def verify(factory: Callable, mesh, *, timeout_s: float = 600, **prepare_kwargs) -> Report:
    """:func:`prepare` and :func:`run` one target.

    >>> report = verify(build, "2", kwargs={"layers": 2}, options=PlanOptions(degrees={"tp": 2}))  # doctest: +SKIP
    >>> report.exact, report.worst                                                                  # doctest: +SKIP
    """
    return run([prepare(factory, mesh, **prepare_kwargs)], timeout_s)[0]


def _merge(target: Target, steps: list[dict]) -> Report:
    errors = [step["error"] for step in steps if "error" in step]
    if errors:
        return Report(target, {}, error=errors[0])
    return Report(
        target,
        steps[0]["degrees"],
        steps[0]["split"],
        max(s["loss"] for s in steps),
        _worst(steps, "grads"),
        _worst(steps, "params"),
    )


def _worst(steps: list[dict], key: str) -> dict[str, float]:
    """Per name, the largest error any rank saw (under pp a rank sees only its stages' names)."""
    worst: dict[str, float] = {}
    for step in steps:
        for name, error in step[key].items():
            worst[name] = max(error, worst.get(name, 0.0))
    return worst


def _rank_steps(rank: int, world: int, targets: list[Target]) -> list[dict]:
    steps = []
    for target in targets:
        try:
            steps.append(_one_step(target))
        except Exception as error:  # noqa: BLE001  (reported with the others; a failure in one rank stops the run)
            steps.append({"error": f"rank {rank}: {type(error).__name__}: {error}"})
    return steps


def _one_step(target: Target) -> dict:
    torch.manual_seed(0)
    model = target.factory(*target.args, **target.kwargs)
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError("the factory builds the model on the meta device: verify needs its weights")
    inputs = model.example_inputs(target.batch)
    pmodel = parallelize(model, target.mesh, inputs, plan=target.plan, options=target.options)

    reference = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS)
    reference_loss = model(*inputs)
    reference_loss = reference_loss[0] if isinstance(reference_loss, tuple) else reference_loss
    reference_loss.backward()
    reference_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    reference.step()
    reference_params = dict(model.named_parameters())

    optimizer = pmodel.optimizer(torch.optim.AdamW, lr=LEARNING_RATE, eps=ADAM_EPS)
    loss = pmodel.train_step(*pmodel.shard_batch(*inputs))
    grads = {name: p.grad.full_tensor() for name, p in pmodel.named_parameters() if p.grad is not None}
    optimizer.step()
    params = {name: p.full_tensor() for name, p in pmodel.named_parameters()}  # this rank's stages' under pp
    # a gradient on one side only is as wrong as can be
    grad_errors = {n: math.inf for n in (set(reference_grads) ^ set(grads)) & set(params)}
    grad_errors.update({n: relative_error(g, reference_grads[n]) for n, g in grads.items() if n in reference_grads})
    return {
        "degrees": pmodel.plan.full_degrees,
        "split": split_counts(pmodel.plan),
        "loss": relative_error(loss, reference_loss),
        "grads": grad_errors,
        "params": {n: relative_error(p, reference_params[n]) for n, p in params.items()},
    }
