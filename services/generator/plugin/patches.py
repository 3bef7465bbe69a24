"""Named fixes to vLLM model code, applied by the plugin in every vLLM process.

Each patch is idempotent and says why it exists; each is checked against the pinned vLLM release by
`tests/integration/generator/test_vllm_plugin.py` (logprobs equal to transformers').
"""

from __future__ import annotations

import functools
import inspect


def qwen3_output_projection_bias() -> None:
    """Give Qwen3's attention output projection a bias when the config's `attention_bias` is set.

    transformers' Qwen3 puts a bias on q/k/v *and* o_proj when `attention_bias` is true; vLLM 0.32's
    Qwen3 builds o_proj without one and its weight loader skips the checkpoint's `o_proj.bias`
    silently, so such a model samples from a different distribution than the trainer scores. Real
    Qwen3 checkpoints have no attention bias; the project's small models do (they learn lookup with
    it), and the generator must reproduce the trainer's policy exactly.
    """
    from vllm.model_executor.layers.linear import RowParallelLinear
    from vllm.model_executor.models import qwen3

    init = qwen3.Qwen3Attention.__init__
    if getattr(init, "_sparrow_patched", False):
        return
    signature = inspect.signature(init)

    @functools.wraps(init)
    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a["qkv_bias"]:
            self.o_proj = RowParallelLinear(
                self.total_num_heads * self.head_dim,
                a["hidden_size"],
                bias=True,
                quant_config=a["quant_config"],
                prefix=f"{a['prefix']}.o_proj",
            )

    patched._sparrow_patched = True
    qwen3.Qwen3Attention.__init__ = patched


def keep_cpu_linear_weights() -> None:
    """Keep each linear layer's plain weight on CPU after vLLM packs it for oneDNN.

    vLLM's CPU path packs every linear weight into a oneDNN handle after loading and then replaces
    the parameter with an empty tensor. A generator must reload policy weights in place after every
    trainer step: with the parameter gone, the model's weight loader has nowhere to write. Keeping
    it costs one more copy of the linear weights in RAM; the worker extension re-packs after a
    reload (`SparrowWorkerExtension.sparrow_load_weights`).
    """
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "_sparrow_patched", False):
        return

    @functools.wraps(dispatch)
    def keeping(layer, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    keeping._sparrow_patched = True
    utils.dispatch_cpu_unquantized_gemm = keeping


def self_draft_proposer() -> None:
    """The target model drafts for itself through block-sparse attention (`plugin.self_draft`, where the two
    patched methods of vLLM's draft-model proposer and their reasons are), and each verified draft is noted
    for the engine's metrics (`self_draft.note_drafts`: vLLM reports acceptance only as running totals), and
    each cycle timed, drafts apart from the verify (`self_draft.time_cycles`: vLLM times neither)."""
    from services.generator.plugin.self_draft import note_drafts, time_cycles
    from services.generator.plugin.self_draft import self_draft_proposer as patch

    patch()
    note_drafts()
    time_cycles()


def cpu_expand_kernel() -> None:
    """Expand per-request floats on CPU correctly: torch in place of vLLM's C++ fallback of `expand_kernel`.

    vLLM 0.32 runs its rejection sampler's Triton kernels on CPU through C++ fallbacks
    (`vllm.utils.cpu_triton_utils`, registered by the platform after the plugins load). The one of
    `expand_kernel` casts its output to int64 before the C++ call, so a float tensor (the per-request
    temperature spread over draft positions) gets a copy written and keeps uninitialised memory: the
    verify's logits are divided by garbage, and sampled speculative decoding emits NaN logprobs and accepts
    a twelfth of the drafts of a draft identical to the target (greedy verification skips this kernel).
    Installed before the platform registers its fallbacks, so vLLM registers this one instead.
    """
    from vllm.utils import cpu_triton_utils

    from services.generator.plugin.cpu_expand import expand

    cpu_triton_utils._expand_kernel_impl = expand


ALL = (qwen3_output_projection_bias, keep_cpu_linear_weights, self_draft_proposer, cpu_expand_kernel)


def apply_all() -> None:
    """Applies every patch (safe to call more than once)."""
    for patch in ALL:
        patch()
