"""The GPU check of the CUDA path, in one run on a machine with one H200 (about 9 minutes at most).

    python -m bench.cuda_check [--deadline-s 540] [--phases kernels,decode,...] [--out FILE] [--dry-run]

Prints one JSON object with every figure and writes it to `$OUT/cuda_check.json` when OUT is set
(and to --out), with the phases' output beside it (`$OUT/cuda_check.log`, else the --out file's
name with `.log`, else in the temp folder). Each phase runs in a child process of its own under a
time limit (cut to what is left of the deadline): a crash, a hang or an out-of-memory is recorded
as that phase's status and the next phase still runs. A phase saves its figures as it goes, so one
stopped at its limit still reports what it measured. Phase status: "ok", "failed" (a check out of
tolerance), "error", "timeout" or "skipped" (with the reason).

  env         versions, the device, whether vLLM imports (the phases marked vLLM skip without it)
  kernels     every Triton kernel against its torch reference on CUDA, float32 and bfloat16, on a
              contiguous cache and on vLLM's NHD cache view (the kernel tests build CPU tensors, so
              they are not rerun here); float64 references; tolerances in `TOL`
  decode      pytest tests/unit/generator/test_cuda_backend.py and test_static_decode.py on CUDA:
              the plugin's decode path (page centroids from slot_mapping, decode under a schedule)
              against float64 oracles at 1e-5, and static decode captured once as a CUDA graph and
              replayed at later steps (other lengths, schedules, probes, dense); the impl's own
              tests run where vLLM imports, against vLLM's real kernel
  attention   one layer's decode step, batch 8 at 32K, Qwen3-1.7B heads, bf16, vLLM's cache layout:
              dense (our kernel, torch SDPA over a contiguous copy, vLLM's kernel if present) vs the
              plugin's sparse decode at 2048 and 4096 tokens (centroid refresh included), wall time
              per call, KV-bytes bound, host syncs per sparse call (must be none); our dense
              kernel checked against SDPA (and vLLM's kernel) and the sparse path at a full budget
              against ours, relative to the largest output (`REL_TOL`)
  model       a whole decode step of a Qwen3-1.7B-shaped model (random bf16 weights, torch linear
              layers, RMSNorm, RoPE, our kernels for attention), batch 8 at 32K over one paged
              cache per layer: dense (our dense kernel in every layer) vs the plugin's sparse
              decode (layers 0-1 dense, centroids refreshed in every layer) at 2048 and 4096
              tokens, eager and replayed as one CUDA graph (the step reads nothing back, so it
              captures whole; that graph serves only its own lengths and schedule); and static
              decode, sized for a 40K engine, whose one capture is replayed under the other
              budgets and a full one (checked against the eager steps and the dense one): what
              vLLM's full graphs would run with `cuda_graphs = "full"`. The sparse step at a full
              budget checked against the dense one. Without vLLM's step overhead; not vLLM's figure
  trainer_memory  two FSDP2 bf16 update steps of a Qwen3-0.6B-shaped model (8 layers, 151,936
              vocabulary) on four 4K rollouts: resident vs per-layer activation checkpointing vs
              checkpointing and CPU offload of the shards and AdamW state; gradients agree, the
              offloaded state is on the CPU, peak GPU memory falls at each; the resident and the
              offloaded model published a tensor at a time (cast on the GPU, or on the host) equal
              byte for byte a CPU publish of the same weights (bench/cuda_check/trainer_memory.py); then one
              step on a 16K-token rollout, chunked vs full LM head: peak GPU memory, tokens/s,
              logprobs and loss agree (bench/cuda_check/trainer_head.py)
  parity      (vLLM) stock vLLM (TRITON_ATTN) vs the plugin, float32, greedy, a random Qwen3 with
              head_dim 128: sampled-token logprobs over the common prefix within 2e-2 at a budget
              covering every page in every layer (vLLM's float32 kernel may use TF32; ours does not),
              exactly equal with no schedule; a small-budget run's drift is reported, not judged
  throughput  (vLLM) engine decode tokens/s, dense vs sparse, batch 8 at 32K, a random
              Qwen3-1.7B-shaped model in bf16, piecewise CUDA graphs

`--dry-run` rehearses the phases' code on a CPU (Triton interpreted, float32, tiny shapes, one thread; the
engine phases skip; the decode phase runs the first test of each of its files, which the suite runs
in full anyway): it proves the script runs, not the figures. The test suite runs the dry run
(`tests/unit/bench/test_cuda_check.py`), so the check cannot rot between the sessions lent a GPU.

The package: one module per phase (`env`, `kernel_checks`, `decode`, `attention`, `model`,
`trainer_memory` with `trainer_head`, `parity` and `throughput` with their engine children in
`engines`), what the phases share in `common`, and the runner that orders them under the deadline in
`runner`.
"""

from bench.cuda_check.runner import PHASES, main, parse_args

__all__ = ["PHASES", "main", "parse_args"]
