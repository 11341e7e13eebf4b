"""What a parallelized program runs on, installed as ``autopar.runtime``.

- ``launch``, ``spawn``, ``process_groups``: start ranks (torchrun-compatible), build the
  DeviceMesh and the c10d groups of its axes;
- ``collectives``: the ``autopar::`` ops rewritten graphs call, each an autograd function with
  its dual as backward; ``kernels/``: context-parallel attention (ring, Ulysses, the zigzag
  sequence layout), the expert-parallel mixture of experts, the vocabulary-parallel embedding
  and cross-entropy, the linears of a gathered input that keep its shard (``gathered_linear``),
  a model's recurrences over time (the gated delta rule, Mamba's selective scan, Griffin's linear
  recurrence) as one op each
  (``recurrences``);
- ``grad_sync``: bucketed gradient all-reduce overlapped with backward; ``zero/``: ZeRO 1-3
  (sharded layout and optimizer, parameter gathers, gradient reduce-scatters; ``zero/compiled``:
  ZeRO-3's per-layer gather op of compiled programs);
- ``compile``: programs through ``torch.compile``; ``functional``: each collective as torch's
  functional collectives (issue, then wait), which compiled programs run;
- ``module`` (``ParallelModule``, ``AccumulatingModule``) and ``pipeline`` (``PipelineModule``):
  the trainable module ``autopar.parallelize`` returns; ``checkpoint``: the logical state on disk;
  ``checkpointer`` (``Checkpointer``): periodic atomic checkpoints of a job and resuming from them;
- ``faults``: an error on one rank becomes an error on every rank (shared before the ranks
  communicate, posted to the store inside a step, collectives that time out named with their
  plan node, in forward and backward);
- ``measure``: what ``autopar calibrate`` times on this machine.

Importing this package registers the ``autopar::`` ops that rewritten graphs call.
"""

from autopar.runtime.checkpoint import load_checkpoint, load_weights, save_checkpoint
from autopar.runtime.checkpointer import Checkpointer
from autopar.runtime.collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    chunk,
    grad_all_reduce,
    grad_all_reduce_accumulated,
    keep_on_first,
    reduce_scatter,
)
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.kernels.context_parallel import ring_attention, ulysses_attention
from autopar.runtime.kernels.expert_parallel import moe, moe_experts
from autopar.runtime.kernels.gathered_linear import gathered_linears
from autopar.runtime.kernels.recurrences import gated_delta_rule, linear_recurrence, selective_scan
from autopar.runtime.kernels.vocab_parallel import vocab_cross_entropy, vocab_embedding
from autopar.runtime.kernels.zigzag import zigzag
from autopar.runtime.launch import finish, free_port, init_from_env, launch_local
from autopar.runtime.process_groups import build_device_mesh, group_name
from autopar.runtime.spawn import run_local
from autopar.runtime.zero.compiled import zero_gather_layer, zero_reduce_scatter_layer, zero_scatter_layer
from autopar.runtime.zero.gather import zero_gather

__all__ = [
    "Checkpointer",
    "GradSync",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "build_device_mesh",
    "chunk",
    "free_port",
    "gated_delta_rule",
    "gathered_linears",
    "grad_all_reduce",
    "grad_all_reduce_accumulated",
    "finish",
    "group_name",
    "init_from_env",
    "keep_on_first",
    "launch_local",
    "linear_recurrence",
    "load_checkpoint",
    "load_weights",
    "moe",
    "moe_experts",
    "reduce_scatter",
    "ring_attention",
    "run_local",
    "save_checkpoint",
    "selective_scan",
    "ulysses_attention",
    "vocab_cross_entropy",
    "vocab_embedding",
    "zero_gather",
    "zero_gather_layer",
    "zero_reduce_scatter_layer",
    "zero_scatter_layer",
    "zigzag",
]
