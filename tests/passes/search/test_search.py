"""Planner tests (one process, no process group): the search finds the textbook answer."""

import pytest
import torch
from equivalence import load_example
from planning import meta_model, plan_example

import autopar
import autopar.runtime.collectives  # noqa: F401  (registers torch.ops.autopar.*)
from autopar.ir import MemoryLimitError, Replicate, Shard, ShardingRuleError, degree_choices, get_profile
from autopar.passes.capture.graph import capture
from autopar.passes.cost.collectives import collective_time
from autopar.passes.cost.kernels import ring_hideable_block
from autopar.passes.rewrite.rewrite import rewrite

WIDE = dict(hidden=1024, ffn=4096, layers=2)
NARROW = dict(hidden=32, ffn=64, layers=2)


def _program(file, model_kwargs, batch, plan):
    model = meta_model(file, **model_kwargs)
    captured = capture(model, model.example_inputs(batch, device="meta"))
    return rewrite(captured, plan, groups={axis: axis for axis in plan.degrees}, device="meta")


def _collectives(program, name):
    return [n for n in program.graph.nodes if n.target is getattr(torch.ops.autopar, name).default]


def test_wide_mlp_small_batch_gets_column_then_row_tensor_parallelism():
    plan = plan_example("mlp.py", 4, batch=8, model_kwargs=WIDE, degrees={"pp": 1})  # the intra-op answer
    assert plan.degrees == {"dp": 1, "tp": 4}
    for block in range(WIDE["layers"]):
        assert plan.params[f"blocks.{block}.fc1.weight"] == (Replicate(), Shard(0))  # column parallel
        assert plan.params[f"blocks.{block}.fc2.weight"] == (Replicate(), Shard(1))  # row parallel
    program = _program("mlp.py", WIDE, 8, plan)
    assert len(_collectives(program, "all_reduce")) == WIDE["layers"]  # exactly one per block
    assert not _collectives(program, "all_gather") and not _collectives(program, "all_to_all")
    # Its cost: those forward all-reduces of the [8, 1024] activations, plus the backward
    # all-reduce of the gradient entering the second block (the first block's input is data).
    link = get_profile(None).link(plan.mesh.shape, 4)
    one = collective_time("all_reduce", 8 * 1024 * 4, 4, link)
    assert plan.cost.comm_s == pytest.approx(3 * one)
    assert plan.cost.grad_sync_s == 0


class _FusedProjection(torch.nn.Module):
    """Falcon's attention input: ``x @ W`` ([B, S, H] @ [H, 3H], no linear) and one head group
    picked by a tensor index after slices (``qkv[:, :, [1]]``)."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden, 3 * hidden))

    def forward(self, x, target):
        qkv = (x @ self.weight).view(*x.shape[:2], 3, x.shape[-1])
        return ((qkv[:, :, [1]].squeeze(2) - target) ** 2).mean()


def test_a_broadcast_matmul_and_an_index_after_slices_split_over_the_batch():
    """Both once had no strategy but replication, so data parallelism ran the whole batch on every rank."""
    inputs = (torch.randn(64, 32, 64), torch.randn(64, 32, 64))
    plan = autopar.plan(_FusedProjection(), 4, inputs, degrees={"dp": 4}, hardware="h100-80gb")
    by_op = {node.split("_")[0]: decision.output for node, decision in plan.nodes.items()}
    assert by_op["matmul"] == (Shard(0), Replicate()) and by_op["index"] == (Shard(0), Replicate()), by_op


class _AlibiScores(torch.nn.Module):
    """BLOOM's attention scores: the ALiBi bias, [batch·heads, 1, seq], added by ``baddbmm``."""

    def __init__(self, hidden: int = 64, heads: int = 4):
        super().__init__()
        self.heads, self.weight = heads, torch.nn.Parameter(torch.randn(hidden, hidden))

    def forward(self, x, target):
        batch, seq, _ = x.shape
        q = (x @ self.weight).view(batch, seq, self.heads, -1).transpose(1, 2).reshape(batch * self.heads, seq, -1)
        alibi = torch.arange(seq, dtype=x.dtype).view(1, 1, seq).expand(batch * self.heads, 1, seq) * 0.1
        scores = torch.baddbmm(alibi, q, q.transpose(1, 2), beta=1.0, alpha=0.25)
        return ((scores - target) ** 2).mean()


def test_alibi_attention_scores_split_over_the_batch():
    """``baddbmm`` had no strategy but replication: data parallelism computed every sequence's scores on
    every rank, its inputs gathered (BLOOM's default config on 64 simulated H100s planned dp 8 x tp 8 at 0.84 s a
    step; with the rule, dp 64 at 0.17 s)."""
    inputs = (torch.randn(64, 32, 64), torch.randn(256, 32, 32))
    plan = autopar.plan(_AlibiScores(), 4, inputs, degrees={"dp": 4}, hardware="h100-80gb")
    scores = plan.nodes["baddbmm"]
    assert scores.output == (Shard(0), Replicate()) and scores.inputs[1:] == ((Shard(0), Replicate()),) * 2, scores


class _MaskedScores(torch.nn.Module):
    """Attention scores plus the mask Hugging Face builds for eager attention (Gemma 2): each row's
    positions looked up at broadcast batch and query indices, compared, filled by ``where``."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden, hidden))

    def forward(self, x, target):
        batch, seq, _ = x.shape
        positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)
        rows = torch.arange(batch)[:, None, None]
        allowed = positions[rows, torch.arange(seq)[None, None, :]] <= positions[rows, torch.arange(seq)[None, :, None]]
        mask = torch.where(allowed, torch.zeros(()), -1e9)
        q = x @ self.weight
        return ((q @ q.transpose(1, 2) + mask - target) ** 2).mean()


def test_an_eager_attention_mask_is_built_split_over_the_batch():
    """The mask's lookups (``index`` with several broadcast index tensors) and its fill (``where`` with a
    number) had no strategy but replication: data parallelism built the whole batch's mask on every rank
    (Gemma 2's [batch, 1, seq, seq])."""
    inputs = (torch.randn(64, 32, 64), torch.randn(64, 32, 32))
    plan = autopar.plan(_MaskedScores(), 4, inputs, degrees={"dp": 4}, hardware="h100-80gb")
    built = [(d.op, d.output) for d in plan.nodes.values() if d.op in ("aten.index.Tensor", "aten.where.ScalarOther")]
    assert len(built) == 3 and all(output == (Shard(0), Replicate()) for _, output in built), built


def test_narrow_mlp_big_batch_gets_data_parallelism():
    plan = plan_example("mlp.py", 4, batch=4096, model_kwargs=NARROW)
    assert plan.degrees == {"dp": 4, "tp": 1}
    assert all(p == (Replicate(), Replicate()) for p in plan.params.values())
    assert set(plan.grad_sync) == set(plan.params) and all(axes == ("dp",) for axes in plan.grad_sync.values())
    program = _program("mlp.py", NARROW, 4096, plan)
    assert len(_collectives(program, "all_reduce")) == 1  # the loss; gradients sync in the runtime


def test_impossible_memory_limit_names_the_breakdown():
    with pytest.raises(MemoryLimitError, match=r"needs .* MiB: params .* grads .* optimizer .* activations"):
        plan_example("mlp.py", 4, batch=8, model_kwargs=WIDE, memory_limit=2**20)


def test_a_plan_that_does_not_fit_names_the_pins_that_kept_leaner_plans_out():
    pinned = r"The pins zero=0 \(zero=3 shards .*\) and recompute='none' \('full' .*\) keep leaner plans out: lift them"
    with pytest.raises(MemoryLimitError, match=pinned):
        plan_example("mlp.py", 4, batch=8, model_kwargs=WIDE, memory_limit=2**20, zero=0, recompute="none")
    with pytest.raises(MemoryLimitError) as unpinned:
        plan_example("mlp.py", 4, batch=8, model_kwargs=WIDE, memory_limit=2**20, zero=3)
    assert "The pin" not in str(unpinned.value) and ". Raise memory_limit" in str(unpinned.value)


def test_a_plan_whose_model_state_alone_does_not_fit_says_so_rather_than_suggest_accumulation():
    """Where every configuration's weights, gradients and optimizer state alone exceed the limit,
    recomputation, accumulation and a smaller batch cannot help: the advice says so."""
    free = plan_example("mlp.py", 4, batch=8, model_kwargs=WIDE)
    state = free.cost.memory["params"] + free.cost.memory["grads"] + free.cost.memory["optimizer"]
    over_state = r"weights, gradients and optimizer state alone exceed the limit"
    with pytest.raises(MemoryLimitError, match=over_state) as below:
        plan_example("mlp.py", 4, batch=8, model_kwargs=WIDE, memory_limit=state / 2)
    assert "accumulate gradients" not in str(below.value)
    with pytest.raises(MemoryLimitError) as above:  # the state fits; one microbatch's activations do not
        plan_example("mlp.py", 4, batch=4096, model_kwargs=WIDE, memory_limit=free.cost.peak_memory, microbatches=1)
    assert "accumulate gradients" in str(above.value) and "alone exceed" not in str(above.value)


def test_a_memory_limit_moves_the_plan_to_zero_then_accumulation_or_tensor_parallelism():
    mlp = dict(model_kwargs=dict(hidden=512, ffn=2048, layers=2), batch=4096)
    free = plan_example("mlp.py", 4, **mlp)
    assert free.degrees == {"dp": 4, "tp": 1} and free.schedule.stages == 1
    whole = plan_example("mlp.py", 4, zero=0, **mlp)
    assert whole.degrees["dp"] == 4
    model_state = whole.cost.memory["params"] + whole.cost.memory["grads"] + whole.cost.memory["optimizer"]
    limit = whole.cost.peak_memory - model_state / 2
    limited = plan_example("mlp.py", 4, memory_limit=limit, **mlp)  # ZeRO or accumulation, whichever is faster
    assert limited.degrees["dp"] == 4 and (limited.zero > 0 or limited.schedule.microbatches > 1)
    assert limited.cost.peak_memory <= limit
    # DDP's answer: fewer rows at once (or, a pass over the gradients per microbatch later, tp 2)
    accumulated = plan_example("mlp.py", 4, memory_limit=limit, zero=0, **mlp)
    assert accumulated.schedule.microbatches > 1 and accumulated.cost.peak_memory <= limit
    accumulated = plan_example("mlp.py", 4, memory_limit=limit, zero=0, degrees={"dp": 4}, **mlp)
    assert accumulated.schedule.microbatches > 1 and accumulated.cost.peak_memory <= limit
    sharded_state = plan_example("mlp.py", 4, memory_limit=limit, zero=1, degrees={"dp": 4}, **mlp)  # more rows at once
    assert sharded_state.schedule.microbatches < accumulated.schedule.microbatches
    assert sharded_state.cost.peak_memory <= limit
    no_zero = plan_example("mlp.py", 4, memory_limit=limit, zero=0, microbatches=1, **mlp)  # the whole batch at once
    assert no_zero.degrees["tp"] > 1 and any(isinstance(p[1], Shard) for p in no_zero.params.values())
    assert no_zero.cost.peak_memory <= limit


def test_pinned_degrees_and_constraints_are_honoured():
    plan = plan_example("gpt.py", "2x2", batch=8, degrees={"dp": 2, "tp": 2}, constraints={"layers.*.mlp.fc1": "S(-1)"})
    assert plan.degrees == {"dp": 2, "tp": 2}
    assert plan.params["layers.0.mlp.fc1.weight"][1] == Shard(0)
    fc1 = [d for d in plan.nodes.values() if d.module == "layers.0.mlp.fc1"]
    assert fc1 and fc1[0].output == (Shard(0), Shard(2))


def test_tensor_parallel_attention_splits_its_heads_on_gpus():
    # On an H100 the virtual sequence axis (which dims a cp split would follow) finds the heads as
    # cheap to split as the sequence; that map must not keep the tp axis from splitting heads
    # (attention ran whole on every tp rank, ~1.6x the FLOPs of Megatron's layout at tp 8)
    model = meta_model("gpt.py", hidden=1024, layers=1, heads=8, vocab=4096, seq=1024)
    megatron = {"layers.*.attn.w[qkv]": "S(-1)", "layers.*.attn.wo": "P", "layers.*.mlp.fc1": "S(-1)"}
    inputs = model.example_inputs(8, device="meta")
    plan = autopar.plan(model, "1x8", inputs, degrees={"tp": 8}, constraints=megatron, hardware="h100-80gb")
    tp = list(plan.degrees).index("tp")
    attention = [d for d in plan.nodes.values() if "scaled_dot_product_attention" in d.op]
    assert attention and all(d.output[tp] == Shard(1) for d in attention)
    assert plan.params["layers.0.attn.wo.weight"][tp] == Shard(1)  # row-parallel: each rank its heads' columns


def test_constraints_that_cannot_hold_are_clear_errors():
    with pytest.raises(ShardingRuleError, match="matches no parameter and no module"):
        plan_example("gpt.py", 2, batch=8, degrees={"tp": 2}, constraints={"no.such.module": "R"})
    with pytest.raises(ShardingRuleError, match=r"module 'layers.0.mlp.fc1'.*cannot be placed S\(0\)"):
        plan_example("gpt.py", 2, batch=8, degrees={"tp": 2}, constraints={"layers.0.mlp.fc1": "S(0)"})


def test_a_pin_holds_as_it_is_where_tensor_parallelism_has_one_device():
    """On a data-parallel mesh the tensor-parallel axis has one device, on which every placement
    is the whole tensor: a pin holds (it was refused, only R being a candidate there); a name the
    model does not have is still an error."""
    plan = plan_example("gpt.py", 2, batch=8, degrees={"dp": 2}, constraints={"layers.*.mlp.fc1": "S(-1)"})
    assert plan.degrees["dp"] == 2
    with pytest.raises(ShardingRuleError, match="matches no parameter and no module"):
        plan_example("gpt.py", 2, batch=8, degrees={"dp": 2}, constraints={"no.such.module": "R"})


def test_a_module_pin_pins_the_ops_that_can_take_it():
    """A BatchNorm module's ops include its count of batches (a 0-d tensor no S(d) splits), its
    statistics (of size 1 along the batch) and the updates of its running statistics (which every
    rank holds whole): pinning the module to its batch split pins the ops that can take it (it was
    refused, naming the counter), and the norm's output is split by the batch."""
    plan = plan_example("cnn.py", 2, batch=8, degrees={"tp": 2}, constraints={"stem.1": "S(0)"})
    (relu,) = [d for d in plan.nodes.values() if d.module == "stem.2"]
    assert relu.inputs == ((Replicate(), Shard(0)),), relu


@pytest.mark.parametrize("builder", ["build_gpt2", "build_llama", "build_mixtral"])
def test_hugging_face_models_plan_and_report_their_coverage(builder):
    plan = plan_example("hf.py", "2x2", batch=8, builder=builder)
    assert plan.params and plan.degrees["dp"] * plan.degrees["tp"] == 4
    # HF checks position ids for packed sequences with diff, which has no rule: it runs
    # replicated and the plan says so (the coverage report); everything else has a rule.
    assert set(plan.replicated_ops) <= {"aten.diff.default"}


def test_llama_70b_layers_plan_for_64_simulated_gpus():
    model = meta_model("hf.py", "build_llama70b_shaped", layers=2)
    # fp32 (the preset's own choice is bf16-mixed, whose faster compute hides fewer ring steps: cp <= 2)
    plan = autopar.plan(model, "8x8", model.example_inputs(64, device="meta"), hardware="a100-80gb", precision="fp32")
    tried = {tuple(entry["degrees"].items()) for entry in plan.search if entry["stages"] == 1}
    # without stages, every split of 64, cp included up to the chunk whose attention hides a ring step: fp32, the
    # 8 K/V heads repeated to 64 and a mask on the meta device (not proved causal): ~150 tokens of 4096
    a100 = get_profile("a100-80gb")
    block = ring_hideable_block(64, 64, 4, a100.flops_per_s("float32"), a100.links[0].bandwidth, causal=False)
    expected = {tuple(c.items()) for c in degree_choices(64, ("cp",)) if c.get("cp", 1) <= 4096 // block}
    assert 4096 // block == 27
    assert plan.mesh.size == 64 and tried == expected
    assert plan.cost.peak_memory <= get_profile("a100-80gb").memory_bytes
    assert next(p for p in model.parameters()).is_meta  # nothing was allocated


def test_long_context_with_tight_memory_splits_the_sequence():
    # one 8192-token sequence: data parallelism has nothing to split, and one device's
    # activations do not fit the limit
    model = meta_model("long_context_gpt.py", "build")
    captured = autopar.capture(model, model.example_inputs(1, device="meta"))
    limit = 80 * 2**20
    with pytest.raises(MemoryLimitError):
        autopar.plan(captured, 1, memory_limit=limit)
    plan = autopar.plan(captured, 4, memory_limit=limit)
    assert plan.degrees.get("cp", 1) > 1 and plan.cost.peak_memory <= limit
    assert all(placement[list(plan.degrees).index("cp")] == Shard(1) for placement in plan.inputs.values())
    single = autopar.plan(captured, 1)  # unlimited: the whole sequence on one device
    assert plan.cost.memory["activations"] < 0.35 * single.cost.memory["activations"]


def test_long_context_on_gpus_runs_attention_as_a_ring():
    # at H100 speeds a K/V block's transfer hides behind its attention: ring over Ulysses
    model = meta_model("long_context_gpt.py", "build", hidden=512, heads=8, seq=16384)
    plan = autopar.plan(model, 4, model.example_inputs(1, device="meta"), degrees={"cp": 4}, hardware="h100-80gb")
    attention = [d for d in plan.nodes.values() if "scaled_dot_product_attention" in d.op]
    assert attention and all(d.kernel == "ring" for d in attention)


def test_moe_example_splits_its_experts_over_devices():
    model = meta_model("moe_gpt.py", "build", hidden=256, ffn=1024)
    inputs = model.example_inputs(8, device="meta")
    plan = autopar.plan(model, 4, inputs)
    experts = [d for d in plan.nodes.values() if d.op == "autopar.moe.default"]
    assert plan.degrees.get("ep", 1) > 1 and experts and all(d.kernel == "experts" for d in experts)
    ep = list(plan.degrees).index("ep")
    assert all(plan.params[name][ep] == Shard(0) for name in plan.params if ".experts." in name)
    replicated = autopar.plan(model, 4, inputs, degrees={"dp": 4})  # every device holds every expert
    assert plan.cost.step_s < replicated.cost.step_s
    assert plan.cost.memory["params"] < replicated.cost.memory["params"]


def test_experts_split_over_ep_hold_their_share_of_weights_and_biases_viewed_or_not():
    """GPT-OSS's experts take their weights transposed and add biases: under the expert-parallel
    kernel each rank holds 1/ep of every expert tensor, as Mixtral's (weights given as they are)."""
    configs = load_example("hf_configs.py", "benchmarks")
    for family in ("gpt_oss", "mixtral"):
        model = configs.small_model(family)
        ids = torch.randint(0, 128, (8, 16))
        experts = {"gpt_oss": "model.layers.*.mlp.experts", "mixtral": "model.layers.*.mlp"}[family]
        plan = autopar.plan(
            model,
            4,
            example_kwargs={"input_ids": ids, "labels": ids},
            degrees={"ep": 4},
            constraints={experts: "experts"},
        )
        ep, names = list(plan.degrees).index("ep"), [name for name in plan.params if ".experts." in name]
        assert len(names) == (8 if family == "gpt_oss" else 4), names  # weights (and biases) of 2 layers
        assert all(plan.params[name][ep] == Shard(0) for name in names), (family, {n: plan.params[n] for n in names})
