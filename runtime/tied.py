"""Weights shared across pipeline stages (a tied input embedding and output head): Megatron's
embedding group.

Each stage module that uses such a weight holds a copy of the same planned shard. A device
running two of those modules (interleaved and V schedules) gives the second its own leaf
sharing the first's storage, so each module's gradient stays its own (the schedule scales
and, for zero-bubble schedules, computes weight gradients per module). After backward the
copies' gradients are summed: on a device into its first leaf (:meth:`TiedWeights.fold`),
across devices by an all-reduce over the group of pipeline ranks holding the weight at the
same place inside their stages (:meth:`TiedWeights.all_reduce`). Every copy then steps with
the same gradient from the same value, so the copies stay equal: ZeRO splits the weight over
each stage's dp as any other, and a checkpoint holds it once, under its name.

Every decision (which weights are shared, by which devices, with which groups) is taken from
the stage programs, which every rank has whole, before the first collective: a model no
rank can run fails on every rank alike, and no rank waits for another that gave up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.ir import Axis, ConfigError, Schedule


def shared_weights(stage_programs, param_names: dict[str, str], schedule: Schedule, zero: int) -> dict[str, tuple]:
    """Parameter name → the stage modules using it, for every parameter used by more than one.

    ZeRO-3 gathers a weight per stage module from the shard that module trains; two modules
    of one device training one weight would need two shards: a ``ConfigError`` (here, on
    every rank) that says what to change.
    """
    users: dict[str, list[int]] = {}
    for stage in stage_programs:
        for placeholder in stage.params:
            users.setdefault(param_names[placeholder], []).append(stage.index)
    shared = {name: tuple(modules) for name, modules in users.items() if len(modules) > 1}
    for name, modules in shared.items():
        devices = [schedule.device_of(module) for module in modules]
        if zero == 3 and len(set(devices)) < len(devices):
            raise ConfigError(
                f"parameter {name!r} is used by stage modules {list(modules)}, two of them on one device; under "
                "ZeRO-3 a weight shared across stages needs each copy on its own device: use a schedule with one "
                "stage module per device (gpipe, 1f1b), ZeRO-1/2, or stage_cuts that keep its uses in one stage"
            )
    return shared


class TiedWeights:
    """This device's copies of the shared weights and the groups their gradients are summed
    over. Built on every rank (it creates process groups, a collective call)."""

    def __init__(self, shared: dict[str, tuple], schedule: Schedule, mesh: DeviceMesh, mine: list[int]):
        self._aliases: dict[str, list[torch.Tensor]] = {}  # name → this device's extra leaves
        self._groups: dict[str, dist.ProcessGroup] = {}
        created: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        pp = mesh.mesh_dim_names.index(Axis.PP)
        for name, modules in sorted(shared.items()):
            devices = tuple(sorted({schedule.device_of(module) for module in modules}))
            if len(devices) > 1 and devices not in created:  # the same order on every rank
                ranks = mesh.mesh.movedim(pp, 0)[list(devices)].reshape(len(devices), -1).T.tolist()
                created[devices], _ = dist.new_subgroups_by_enumeration(ranks)
            if len(devices) > 1 and created[devices] is not None:
                self._groups[name] = created[devices]
        self.shared = {name: [module for module in modules if module in mine] for name, modules in shared.items()}
        # a shared weight's summed gradient is the same on each device holding it: a norm counts it on the first
        first = {name: min(map(schedule.device_of, modules)) for name, modules in shared.items()}
        self.counted_elsewhere = {name for name, device in first.items() if device != schedule.device_of(mine[0])}

    def leaf(self, name: str, module: int, first: torch.Tensor) -> torch.Tensor:
        """The leaf stage module ``module`` trains for parameter ``name``: ``first`` (this device's
        own) for the first module of the device using it, else a leaf sharing its storage."""
        holders = self.shared.get(name, [module])
        if module == holders[0]:
            return first
        alias = first.detach().requires_grad_(first.requires_grad)
        self._aliases.setdefault(name, []).append(alias)
        return alias

    def fold(self, owners: dict[str, torch.Tensor]) -> None:
        """Add each extra leaf's gradient into this device's own leaf for the weight (``owners``:
        name → the leaf holding its gradient) and clear it."""
        for name, aliases in self._aliases.items():
            for alias in aliases:
                if alias.grad is not None:
                    owner = owners[name]
                    owner.grad = alias.grad if owner.grad is None else owner.grad.add_(alias.grad)
                    alias.grad = None

    def all_reduce(self, owners: dict[str, torch.Tensor]) -> None:
        """Sum each shared weight's gradient over the devices holding it (after the dp sync)."""
        for name, group in self._groups.items():
            owner = owners[name]
            if not owner.requires_grad:
                continue
            if owner.grad is None:  # no microbatch reached it here: take part with zeros
                owner.grad = torch.zeros_like(owner)
            dist.all_reduce(owner.grad, group=group)
