"""Compile every Triton kernel of `kernels` for a CUDA target, no GPU needed (Triton ships ptxas).

Run as a script in a process without TRITON_INTERPRET (the interpreter replaces kernels at
decoration time): `python tests/unit/kernels/gpu_compile.py [arch ...]`. Prints one line per
compiled variant and exits non-zero on the first failure. Catches what the interpreter cannot:
type errors of the compiler, unsupported ops, bad layouts for tl.dot.
"""

from __future__ import annotations

import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

from kernels.centroids import _centroids_at_slots_kernel, _update_centroids_kernel  # noqa: E402
from kernels.decode import _decode_combine_kernel, _decode_split_kernel  # noqa: E402
from kernels.select import _score_blocks_kernel, _select_blocks_kernel  # noqa: E402

DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


# The launcher turns integer arguments equal to 1 into constants and marks pointers and integers that
# are multiples of 16; contiguous tensors of head_dim 128 give exactly these, so compile with them.
UNIT_STRIDES = {"stride_qd", "stride_kd", "stride_vd", "stride_cd", "stride_od", "stride_pod", "stride_sp"}
UNIT_STRIDES |= {"stride_op", "stride_on", "stride_tb", "stride_pn", "stride_ls"}
DIVISIBLE = {"head_dim", "block_size", "stride_kb", "stride_kh", "stride_kt", "stride_vb", "stride_vh", "stride_vt"}
DIVISIBLE |= {"stride_cb", "stride_ch", "stride_cp", "stride_qr", "stride_qh", "stride_or", "stride_oh"}
DIVISIBLE |= {"stride_por", "stride_poh", "stride_pos"}


def _compile(fn, pointers: dict[str, str], constexprs: dict, arch: int, num_warps: int = 4, int_type: str = "i32"):
    constexprs = dict(constexprs) | {name: 1 for name in fn.arg_names if name in UNIT_STRIDES}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name == "qk_scale" else int_type
        if name in pointers or name in DIVISIBLE:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": 2})


def variants():
    """(label, kernel, pointer types, constexprs, num_warps, int type) of every configuration we launch."""
    for dtype in DTYPES.values():
        for has_prev in (False, True):
            yield (
                f"update_centroids {dtype} prev={has_prev}",
                _update_centroids_kernel,
                {"k_ptr": f"*{dtype}", "cent_ptr": "*fp32", "table_ptr": "*i32", "seq_lens_ptr": "*i32"}
                | {"prev_lens_ptr": "*i64"},
                {"HAS_PREV": has_prev, "PAGE": 16, "BLOCK_D": 128},
                4,
                "i32",
            )
        yield (
            f"centroids_at_slots {dtype}",
            _centroids_at_slots_kernel,
            {"k_ptr": f"*{dtype}", "cent_ptr": "*fp32", "slots_ptr": "*i64"},
            {"PAGE": 16, "BLOCK_D": 128},
            4,
            "i32",
        )
        for block_g, skip_dense in ((1, False), (8, False), (8, True)):
            yield (
                f"score_blocks {dtype} group={block_g} skip_dense={skip_dense}",
                _score_blocks_kernel,
                {"q_ptr": f"*{dtype}", "cent_ptr": "*fp32", "table_ptr": "*i64", "seq_lens_ptr": "*i32"}
                | {"budgets_ptr": "*i32", "out_ptr": "*fp32"},
                {"PAGE": 16, "SKIP_DENSE": skip_dense, "BLOCK_G": block_g, "BLOCK_D": 128, "BLOCK_P": 64},
                4,
                "i32",
            )
        # As the wrapper launches it: float32 takes 16 tokens a step on 8 warps.
        block_n, warps = (16, 8) if dtype == "fp32" else (64, 4)
        for dense, row_slots in ((True, False), (False, False), (False, True)):
            for single in (True, False):
                yield (
                    f"decode_split {dtype} dense={dense} row_slots={row_slots} single={single}",
                    _decode_split_kernel,
                    {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"}
                    | {"table_ptr": "*i32", "seq_lens_ptr": "*i32", "pages_ptr": "*i32", "budgets_ptr": "*i32"}
                    | {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"},
                    {"DENSE": dense, "ROW_SLOTS": row_slots, "SINGLE_SPLIT": single, "PAGE": 16, "BLOCK_G": 16}
                    | {"BLOCK_D": 128, "BLOCK_N": block_n, "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32"},
                    warps,
                    "i32",
                )
        yield (
            f"decode_combine {dtype}",
            _decode_combine_kernel,
            {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": f"*{dtype}"},
            {"BLOCK_S": 16, "BLOCK_D": 128},
            4,
            "i32",
        )
    yield (
        "decode_split bf16 64-bit strides",
        _decode_split_kernel,
        {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "table_ptr": "*i64"}
        | {"seq_lens_ptr": "*i64", "pages_ptr": "*i64", "budgets_ptr": "*i64", "part_out_ptr": "*fp32"}
        | {"part_lse_ptr": "*fp32"},
        {"DENSE": False, "ROW_SLOTS": True, "SINGLE_SPLIT": False, "PAGE": 16, "BLOCK_G": 16, "BLOCK_D": 64}
        | {"BLOCK_N": 128, "DOT_PRECISION": "tf32"},
        4,
        "i64",
    )
    for block_n, warps in ((16, 4), (2048, 4), (8192, 8)):
        yield (
            f"select_blocks pages<={block_n}",
            _select_blocks_kernel,
            {"scores_ptr": "*fp32", "seq_lens_ptr": "*i32", "budgets_ptr": "*i64", "out_ptr": "*i32"},
            {"PAGE": 16, "BLOCK_N": block_n},
            warps,
            "i32",
        )


def main(archs: list[int]) -> int:
    for arch in archs:
        for label, fn, pointers, constexprs, warps, int_type in variants():
            compiled = _compile(fn, pointers, constexprs, arch, warps, int_type)
            print(f"sm_{arch} {label}: ok ({len(compiled.asm['cubin'])} bytes of cubin)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:]] or [90]))
