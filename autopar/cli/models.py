"""MODEL arguments: an example name or ``path/to/file.py:factory(k=v, ...)``, built on meta."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from autopar.api import EXAMPLE_SEQ
from autopar.cli.arguments import DEFAULT_FACTORY, UsageError
from autopar.ir import ConfigError
from autopar.passes.capture.calls import bind_call, example_call

REPO_ROOT = Path(__file__).resolve().parents[2]  # where examples/ lives in a source checkout


@dataclass(frozen=True)
class Factory:
    """A model factory named by its file and function: picklable, so spawned ranks can build the
    model themselves (``autopar verify``). Calling it calls the function; ``inspect.signature``
    sees the function's parameters.

    >>> Factory("examples/gpt.py", "build")(layers=1)   # doctest: +SKIP
    """

    path: str
    name: str

    def function(self):
        module_name = self.module_name
        module = sys.modules.get(module_name)
        if getattr(module, "__file__", None) != self.path:
            module_spec = importlib.util.spec_from_file_location(module_name, self.path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            module_spec.loader.exec_module(module)
        return getattr(module, self.name, None)

    @property
    def module_name(self) -> str:
        return "autopar_model_" + re.sub(r"\W", "_", Path(self.path).stem)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.function())

    def __call__(self, *args, **kwargs):
        return self.function()(*args, **kwargs)


def load_model(spec: str) -> torch.nn.Module:
    """Build MODEL on the meta device: ``FILE.py[:FACTORY(k=v, ...)]`` or an example name.

    >>> load_model("examples/gpt.py:build(hidden=64, layers=1)")   # doctest: +SKIP
    GPT(...)
    """
    factory, args, kwargs = model_factory(spec)
    try:
        with torch.device("meta"):
            model = factory(*args, **kwargs)
    except Exception as error:  # the user's factory: any failure is a bad MODEL
        raise UsageError(f"MODEL {spec!r}: {factory.name}(...) raised {type(error).__name__}: {error}") from error
    try:
        if not callable(getattr(model, "example_inputs", None)):
            example_call(model, 2, 2)  # autopar makes a Hugging Face model's inputs (on meta: free)
    except ConfigError:
        raise UsageError(
            f"MODEL {spec!r}: {factory.name}() returned a {type(model).__name__} without "
            "example_inputs(batch_size, device=None), which autopar needs to trace it (or a Hugging Face model "
            "taking token ids or images, whose inputs and labels autopar makes)"
        ) from None
    return model


def model_call(model: torch.nn.Module, batch: int, seq: int | None) -> dict:
    """The call MODEL is planned with, its arguments by name: ``example_inputs(batch)`` on meta,
    else (a Hugging Face causal LM) ``seq`` tokens per sequence (``--seq``)."""
    if callable(getattr(model, "example_inputs", None)):
        if seq is not None:
            raise UsageError(
                f"--seq: {type(model).__name__} makes its own inputs (example_inputs); set their length through "
                "its factory's arguments"
            )
        return bind_call(model, tuple(model.example_inputs(batch, device="meta")), {})
    return example_call(model, batch, seq or EXAMPLE_SEQ)


def model_factory(spec: str) -> tuple[Factory, list, dict]:
    """MODEL as its factory and the arguments it is called with; a bad file or name is a UsageError."""
    location, factory_name, args, kwargs = _parse_model(spec)
    path = _resolve_model_file(location, spec)
    factory = Factory(str(path), factory_name)
    try:
        function = factory.function()
    except Exception as error:  # the user's file: any failure is a bad MODEL
        raise UsageError(f"MODEL {spec!r}: importing {path} failed: {type(error).__name__}: {error}") from error
    if not callable(function):
        module = sys.modules[factory.module_name]
        available = sorted(name for name, value in vars(module).items() if callable(value) and name.startswith("build"))
        raise UsageError(f"MODEL {spec!r}: {path} has no function {factory_name!r}; it has {available or 'no build*'}")
    return factory, args, kwargs


def _parse_model(spec: str) -> tuple[str, str, list, dict]:
    paren = spec.find("(")
    colon = spec.rfind(":", 0, paren if paren >= 0 else len(spec))
    location, call = (spec[:colon], spec[colon + 1 :]) if colon >= 0 else (spec, DEFAULT_FACTORY)
    if not location.strip() or "(" in location:
        raise UsageError(f"MODEL {spec!r}: write FILE.py[:FACTORY(k=v, ...)] or an example name such as gpt")
    try:
        tree = ast.parse(call.strip(), mode="eval").body
    except SyntaxError:
        raise UsageError(
            f"MODEL {spec!r}: cannot read the factory call {call!r}; write e.g. build(hidden=64, layers=2)"
        ) from None
    if isinstance(tree, ast.Name):
        return location.strip(), tree.id, [], {}
    if not isinstance(tree, ast.Call) or not isinstance(tree.func, ast.Name):
        raise UsageError(f"MODEL {spec!r}: the factory must be a function name or a call such as build(layers=2)")
    try:
        args = [ast.literal_eval(arg) for arg in tree.args]
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in tree.keywords if kw.arg is not None}
    except ValueError:
        raise UsageError(f"MODEL {spec!r}: factory arguments must be Python literals (numbers, strings, ...)") from None
    if any(kw.arg is None for kw in tree.keywords):
        raise UsageError(f"MODEL {spec!r}: **kwargs is not supported; name each argument")
    return location.strip(), tree.func.id, args, kwargs


def _resolve_model_file(location: str, spec: str) -> Path:
    is_path = location.endswith(".py") or "/" in location or "\\" in location
    relative = Path(location) if is_path else Path("examples") / f"{location}.py"
    candidates = (
        [Path.cwd() / relative] if Path(location).is_absolute() else [Path.cwd() / relative, REPO_ROOT / relative]
    )
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise UsageError(f"MODEL {spec!r}: no file {relative} (looked in {', '.join(str(c.parent) for c in candidates)})")
