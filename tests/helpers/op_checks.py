"""Shared by the custom-op tests: torch.library.opcheck over several ops, a program's loss and
input gradients, and the error a call raises, inside a rank."""

import torch


def opcheck_failures(calls: dict) -> dict:
    """opcheck (schema, autograd registration, fake impl) of ``torch.ops.autopar.<name>`` on each
    name's arguments; the failures by name, for the parent process to assert there are none."""
    failures = {}
    for name, args in calls.items():
        try:
            torch.library.opcheck(
                getattr(torch.ops.autopar, name).default,
                args,
                test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
            )
        except Exception as error:  # reported to the parent, which asserts there is none
            failures[name] = repr(error)
    return failures


def loss_and_grads(program, inputs: tuple) -> tuple:
    """``program(*inputs)``'s loss and the gradients of its inputs, on fresh leaves."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    loss = program(*leaves)
    loss.backward()
    return loss.detach(), [leaf.grad for leaf in leaves]


def error_of(fn) -> str:
    """``"Type: message"`` of the ValueError (autopar's errors included) ``fn()`` raises, else "no error"."""
    try:
        fn()
    except ValueError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"
