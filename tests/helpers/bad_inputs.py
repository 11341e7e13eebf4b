"""User mistakes and the error each one gets: the table tests/autopar/test_bad_inputs.py checks
and benchmarks/bad_input_table.py renders into BENCHMARKS.md.

Each :class:`Mistake` makes one mistake as a user would (``make(folder)`` runs in ``folder``,
where plan files are written) and returns what the user sees: ``"ErrorClass: message"``, or a
command's exit code and its last line. Mistakes with ``in_ranks`` need a process group; they run
together on two local gloo ranks (:func:`in_ranks`), rank 0's text being the one shown.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from equivalence import ROOT, load_example
from mistaken_models import LearnedPositions, OffsetPositions, RotaryTooShort, SplitByCounts, UnsetTopK, gpt_neo

import autopar
from autopar.ir import AutoparError
from autopar.runtime.spawn import run_local


@dataclass(frozen=True)
class Mistake:
    what: str  # the input, as the table shows it
    error: str  # the error class the user gets (or the exit code of a command)
    says: str  # a regex the text must match: what is wrong, and what to do
    make: Callable[[Path], str]
    in_ranks: bool = False


def _cnn():
    with torch.device("meta"):
        return load_example("cnn.py").build(width=8, blocks=1, stages=1)


def caught(action: Callable[[], object]) -> str:
    """``"ErrorClass: message"`` of the AutoparError ``action`` raises, or ``"no error"``."""
    try:
        action()
    except AutoparError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _mlp(**kwargs):
    torch.manual_seed(0)
    return load_example("mlp.py").build(**kwargs)


def _plan_mlp(**pins):
    model = _mlp()
    return autopar.plan(model, 2, model.example_inputs(8), **pins)


def _edited_plan(folder: Path, edit: Callable[[dict], None]) -> str:
    data = json.loads(json.dumps(_plan_mlp(degrees={"dp": 1, "tp": 2}).to_json()))
    edit(data)
    path = folder / "plan.json"
    path.write_text(json.dumps(data, indent=1))
    return "plan.json"


def _load_edited(folder: Path, edit: Callable[[dict], None]) -> str:
    return caught(lambda: autopar.Plan.load(_edited_plan(folder, edit)))


def _truncated(folder: Path) -> str:
    (folder / "plan.json").write_text(json.dumps(_plan_mlp().to_json())[:500])
    return caught(lambda: autopar.Plan.load("plan.json"))


def _set(path: str, value) -> Callable[[dict], None]:
    """An edit: the JSON field at ``path`` ("params.blocks.0.fc1.weight.1", dots between keys) set to ``value``."""

    def edit(data: dict) -> None:
        *parents, leaf = _keys(data, path)
        target = data
        for key in parents:
            target = target[key]
        if value is DELETE:
            del target[leaf]
        else:
            target[leaf] = value

    return edit


DELETE = object()


def _keys(data: dict, path: str) -> list:
    """Split a dotted path where parameter names hold dots themselves: the longest key that exists wins."""
    keys, rest, target = [], path, data
    while rest:
        if isinstance(target, list):
            head, _, rest = rest.partition(".")
            keys.append(int(head))
        else:
            head = max((k for k in target if rest == k or rest.startswith(k + ".")), key=len)
            keys.append(head)
            rest = rest[len(head) + 1 :]
        target = target[keys[-1]]
    return keys


def _script_crashing_in_rank_1(folder: Path) -> str:
    script = folder / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, time
            if os.environ["RANK"] == "1":
                raise RuntimeError("the batch file is missing")
            time.sleep(60)
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "autopar.cli", "run", "train.py", "--nproc", "2"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1]}"


# -- inside two ranks ---------------------------------------------------------------------------
def _pmodel():
    model = _mlp()
    return autopar.parallelize(model, 2, model.example_inputs(8), degrees={"dp": 2})


def _global_batch_as_local():
    pmodel = _pmodel()
    pmodel.train_step(*_mlp().example_inputs(8))


def _float64_inputs():
    pmodel = _pmodel()
    pmodel.train_step(*(x.double() for x in pmodel.shard_batch(*_mlp().example_inputs(8))))


def _inputs_of_another_rank():
    pmodel = _pmodel()
    pmodel.train_step(*(x.unsqueeze(0) for x in pmodel.shard_batch(*_mlp().example_inputs(8))))


def _mesh_of_another_size():
    model = _mlp()
    autopar.parallelize(model, 4, model.example_inputs(8))


def _plan_of_another_model(folder: Path):
    path = _plan_mlp(degrees={"dp": 2}).save(_own(folder) / "mlp_plan.json")
    torch.manual_seed(0)
    gpt = load_example("gpt.py").build(hidden=32, layers=1, heads=2, vocab=64, seq=8)
    autopar.parallelize(gpt, 2, gpt.example_inputs(8), plan=str(path))


def _plan_with_a_dim_the_weight_lacks(folder: Path):
    path = _own(folder) / _edited_plan(_own(folder), _set("params.blocks.0.fc1.weight.1", "S(5)"))
    model = _mlp()
    autopar.parallelize(model, 2, model.example_inputs(8), plan=str(path))


def _own(folder: Path) -> Path:
    """This rank's own subfolder: ranks write their plan files side by side, not over each other."""
    import torch.distributed as dist

    own = folder / f"rank{dist.get_rank()}"
    own.mkdir(exist_ok=True)
    return own


def _microbatches_not_dividing():
    model = _mlp()
    autopar.parallelize(model, 2, model.example_inputs(8), degrees={"dp": 2}, microbatches=3)


class _PythonCountdown(torch.nn.Module):
    """Scales each position by a tensor made from Python data of the call's length (as CPM-Ant's
    ``torch.tensor(list(range(seqlen))[::-1])``): torch.export keeps it as a constant."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        countdown = torch.tensor(list(range(x.shape[1]))[::-1], dtype=x.dtype)
        return (x * self.weight * countdown[:, None]).square().mean()


def _constant_of_another_call():
    pmodel = autopar.parallelize(_PythonCountdown(), 2, (torch.randn(4, 8, 4),), degrees={"dp": 2})
    pmodel(torch.randn(4, 6, 4))


def in_ranks(mistakes: list[Mistake], folder: Path) -> dict[str, str]:
    """The texts of the ``in_ranks`` mistakes, made on two local gloo ranks in one spawn (rank 0's)."""
    texts = run_local(_make_all, 2, [m.make for m in mistakes], folder, timeout_s=180)
    return dict(zip((m.what for m in mistakes), texts[0]))


def _make_all(rank: int, world: int, makes: list, folder: Path) -> list[str]:
    return [make(folder) for make in makes]


@dataclass(frozen=True)
class _ranked:  # noqa: N801  (reads as a function in the table; a class so that it pickles into the ranks)
    """A mistake made inside a rank: ``action()`` (or ``action(folder)``), its error's text."""

    action: Callable[..., None]
    takes_folder: bool = False

    def __call__(self, folder: Path) -> str:
        return caught(lambda: self.action(folder) if self.takes_folder else self.action())


MISTAKES = [
    Mistake(
        "constraints={'blocks.0.fc1.weight': 'S(7)'} on a 2-D weight",
        "ShardingRuleError",
        r"has 2 dims .*S\(d\) needs -2 <= d < 2: pin a dim it has",
        lambda folder: caught(lambda: _plan_mlp(degrees={"tp": 2}, constraints={"blocks.0.fc1.weight": "S(7)"})),
    ),
    Mistake(
        "constraints={'blocks.0.fc1.weight': 'S(0)'} where tp=4 does not divide its 6 rows",
        "ShardingRuleError",
        r"dim 0 has size 6 here, which tp=4 does not split evenly.*Change the constraint or the degrees",
        lambda folder: caught(
            lambda: autopar.plan(
                _mlp(hidden=6, ffn=6),
                4,
                _mlp(hidden=6, ffn=6).example_inputs(8),
                degrees={"tp": 4},
                constraints={"blocks.0.fc1.weight": "S(0)"},
            )
        ),
    ),
    Mistake(
        "constraints={'blocks.*.fc3': 'P'}: a name the model does not have",
        "ShardingRuleError",
        r"matches no parameter and no module: check the name",
        lambda folder: caught(lambda: _plan_mlp(degrees={"tp": 2}, constraints={"blocks.*.fc3": "P"})),
    ),
    Mistake(
        "degrees={'dp': 3} on a mesh of 4 devices",
        "ConfigError",
        r"multiply to 3, which does not divide the 4 devices",
        lambda folder: caught(lambda: autopar.plan(_mlp(), 4, _mlp().example_inputs(8), degrees={"dp": 3})),
    ),
    Mistake(
        "degrees={'dp': 4} for a global batch of 6",
        "ConfigError",
        r"4 ranks split the global batch of 6, which 4 does not divide: pass a batch that is a multiple of 4",
        lambda folder: caught(lambda: autopar.plan(_mlp(), 4, _mlp().example_inputs(6), degrees={"dp": 4})),
    ),
    Mistake(
        "degrees={'cp': 2} for a sequence of 6 tokens",
        "ConfigError",
        r"cp=2 splits the sequence into 4 chunks .* \[6\] do not divide: pass a multiple of 4",
        lambda folder: caught(lambda: _long_context(seq=6, degrees={"cp": 2})),
    ),
    Mistake(
        "a model with 8 learned positions planned for sequences of 16 tokens",
        "ConfigError",
        r"wpe looks up row 15 of its 8-row table .*: the model holds 8 positions; call it on sequences of at most 8",
        lambda folder: caught(lambda: autopar.plan(LearnedPositions(8), 2, (torch.randn(4, 16, 4),))),
    ),
    Mistake(
        "a Hugging Face GPT-Neo with 8 positions planned for sequences of 16 tokens",
        "TraceError",
        r"The call has 16 tokens and the model's config holds 8 positions \(max_position_embeddings\): call it",
        lambda folder: caught(lambda: autopar.plan(gpt_neo(positions=8), 2, example_kwargs=_tokens(2, 16))),
    ),
    Mistake(
        "a model whose 8 configured positions start past a padding index (as ProphetNet's), called on 8 tokens",
        "TraceError",
        r"The call has 8 tokens, every position the model's config holds \(max_position_embeddings\); a model that "
        r"offsets its positions \(past a padding index\) holds fewer: call it on fewer tokens",
        lambda folder: caught(lambda: autopar.plan(OffsetPositions(), 2, (torch.randint(0, 64, (4, 8)),))),
    ),
    Mistake(
        "a model whose configuration leaves its router's top-k unset (torch.topk(x, k=None), as DeepSeek-V2's default)",
        "TraceError",
        r"(?s)TypeError: topk\(\): .*The model's own code raised this, not torch.export: .* Run the model once",
        lambda folder: caught(lambda: autopar.plan(UnsetTopK(), 2, (torch.randn(4, 8),))),
    ),
    Mistake(
        "a model whose configuration gives its heads 8 dimensions and its rotary table 4 (sizes that disagree)",
        "TraceError",
        r"(?s)RuntimeError: Attempting to broadcast .*The shapes at the model's line above disagree, not "
        r"torch.export: .* Run the model once",
        lambda folder: caught(lambda: autopar.plan(RotaryTooShort(), 2, (torch.randn(4, 16),))),
    ),
    Mistake(
        "a model on the meta device splitting tokens by counts it computes (x.split(counts.tolist()), as JetMoE)",
        "ConfigError",
        r"item .* in the model reads a size from the data \(u\d+: .*\), which a model on the meta device cannot "
        r"compute: plan it with real weights",
        lambda folder: caught(lambda: autopar.plan(_meta(SplitByCounts), 2, (torch.randn(8, 4, device="meta"),))),
    ),
    Mistake(
        "degrees={'mp': 2}: a parallel dimension autopar does not have",
        "ConfigError",
        r"unknown parallel dimension\(s\) \['mp'\]; choose from",
        lambda folder: caught(lambda: _plan_mlp(degrees={"mp": 2})),
    ),
    Mistake(
        "degrees={'pp': 2} on a network with BatchNorm in training (examples/cnn.py)",
        "ConfigError",
        r"of stem\.1 takes statistics over the batch: run in microbatches, .* plan it without pipeline stages or "
        r"microbatches \(degrees=\{'pp': 1\}, microbatches=1\)",
        lambda folder: caught(lambda: autopar.plan(_cnn(), 2, _cnn().example_inputs(8), degrees={"pp": 2})),
    ),
    Mistake(
        'a plan file edited to "degrees": {"dp": "two", ...}',
        "InvalidPlanError",
        r"field 'degrees.dp' is 'two', which is not a positive integer",
        lambda folder: _load_edited(folder, _set("degrees.dp", "two")),
    ),
    Mistake(
        'a plan file edited to place a weight "S(x)"',
        "InvalidPlanError",
        r"field 'params.blocks.0.fc1.weight\[1\]' is 'S\(x\)', which is not a placement",
        lambda folder: _load_edited(folder, _set("params.blocks.0.fc1.weight.1", "S(x)")),
    ),
    Mistake(
        'a plan file with its "nodes" deleted',
        "InvalidPlanError",
        r"missing nodes\. Restore the field names autopar wrote, or re-run autopar.plan",
        lambda folder: _load_edited(folder, _set("nodes", DELETE)),
    ),
    Mistake(
        'a plan file edited to "degrees": {"dp": 2, "tp": 2} on its mesh of 2',
        "InvalidPlanError",
        r"field 'degrees' is .* product times 1 stage\(s\) is the mesh's 2 devices",
        lambda folder: _load_edited(folder, _set("degrees.dp", 2)),
    ),
    Mistake(
        "a plan file cut off in the middle",
        "InvalidPlanError",
        r"plan.json: not JSON .*re-save the plan",
        _truncated,
    ),
    Mistake(
        "a plan file edited to place a 2-D weight S(5)",
        "InvalidPlanError",
        r"places parameter 'blocks.0.fc1.weight' \(shape \[256, 64\]\) S\(5\) on 'tp', a dim it does not have",
        _ranked(_plan_with_a_dim_the_weight_lacks, takes_folder=True),
        in_ranks=True,
    ),
    Mistake(
        "parallelize(gpt, ..., plan='mlp_plan.json'): a plan for another model",
        "StalePlanError",
        r"the plan was made for graph \w+, but this model captures as \w+: re-run autopar.plan",
        _ranked(_plan_of_another_model, takes_folder=True),
        in_ranks=True,
    ),
    Mistake(
        "parallelize(model, 4, ...) in a world of 2 ranks",
        "MeshError",
        r"mesh 4 has 4 devices but the world has 2 ranks: launch 4 processes or pass a mesh of 2 devices",
        _ranked(_mesh_of_another_size),
        in_ranks=True,
    ),
    Mistake(
        "microbatches=3 for a local batch of 4",
        "ConfigError",
        r"3 microbatches must divide the local batch of 4",
        _ranked(_microbatches_not_dividing),
        in_ranks=True,
    ),
    Mistake(
        "a model making a tensor from Python data of the call's length, called at another length",
        "ConfigError",
        r"the model makes a tensor from Python data \(\w+: .* \(6,\) here, \(8,\) in the planning call\): autopar "
        r"keeps the planning call's. Plan with inputs of the sizes you call it with",
        _ranked(_constant_of_another_call),
        in_ranks=True,
    ),
    Mistake(
        "train_step(x.double(), ...): inputs of another dtype",
        "InputError",
        r"input 'x' \(argument 1\) is float64 \[4, 64\], but the plan takes float32 \[4, 64\] on this rank",
        _ranked(_float64_inputs),
        in_ranks=True,
    ),
    Mistake(
        "train_step(x.unsqueeze(0), ...): inputs of another rank",
        "InputError",
        r"is float32 \[1, 4, 64\], but the plan takes float32 \[4, 64\] on this rank \(the global \[8, 64\] split",
        _ranked(_inputs_of_another_rank),
        in_ranks=True,
    ),
    Mistake(
        "train_step(*global_batch): the global batch where this rank's slice belongs",
        "InputError",
        r"is float32 \[8, 64\], but the plan takes float32 \[4, 64\] .*pass pmodel.shard_batch\(\*global_batch\)",
        _ranked(_global_batch_as_local),
        in_ranks=True,
    ),
    Mistake(
        "autopar run train.py --nproc 2, where rank 1 raises",
        "exit 1",
        r"exit 1: \[launch\] rank 1 exited with code 1; terminating ranks \[0\]",
        _script_crashing_in_rank_1,
    ),
]


def _meta(factory):
    with torch.device("meta"):
        return factory()


def _tokens(batch: int, seq: int) -> dict:
    ids = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _long_context(seq: int, degrees: dict):
    with torch.device("meta"):
        model = load_example("long_context_gpt.py").build(hidden=32, layers=1, heads=4, vocab=64, seq=seq)
    return autopar.plan(model, 2, model.example_inputs(2, device="meta"), degrees=degrees)


def table_markdown(texts: dict[str, str]) -> str:
    """The mistakes and what each gets, as a Markdown table."""
    rows = ["| mistake | what autopar says |", "| --- | --- |"]
    for mistake in MISTAKES:
        text = texts[mistake.what].replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {mistake.what.replace('|', chr(92) + '|')} | `{text}` |")
    return "\n".join(rows)


__all__ = ["MISTAKES", "ROOT", "Mistake", "in_ranks", "table_markdown"]
