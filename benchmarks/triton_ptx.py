"""Whether a change to the project's long Triton attention kernels changes their machine code:
compiles the paged attention kernel (`ops/triton_attention.py`) and the absorbed
cross-attention kernel (`ops/triton_absorbed.py`) for sm_90 as a git revision has them and as
the working tree has them, and compares the PTX (its DWARF sections and labels left out: they
name inlined helpers). No GPU needed: the `triton` wheel ships ptxas. Identical PTX means a
refactor (helpers split out, arguments regrouped) cannot change speed or results.

    pip install triton && python3 benchmarks/triton_ptx.py --base HEAD~1
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PAGED = "v1/attention/ops/triton_attention.py"
ABSORBED = "v1/attention/ops/triton_absorbed.py"


def compile_ptx(fn: Any, types: dict[str, str], constexprs: dict[str, Any], warps: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {
        name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    options = {"num_warps": warps, "num_stages": 2}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def code_lines(ptx: str) -> list[str]:
    """The PTX's instructions and declarations: no debug sections, locations, comments,
    labels or kernel names."""
    lines = []
    for line in ptx.split(".section")[0].splitlines():
        s = line.strip()
        if not s or s.startswith((".loc", "//", ".file")) or re.fullmatch(r"\$L__\w+:", s):
            continue
        if "_kernel" not in s:
            lines.append(re.sub(r"\$L__\w+", "L", s))
    return lines


def module_at(rev: str | None, path: str, name: str) -> Any:
    """The module `path` as revision `rev` holds it (None: the working tree)."""
    if rev is None:
        file = REPO / path
    else:
        text = subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=REPO, check=True, capture_output=True, text=True
        ).stdout
        file = Path(tempfile.mkdtemp()) / Path(path).name
        file.write_text(text)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def paged_cases() -> list[tuple[str, dict[str, str], dict[str, Any], int]]:
    types = {n: "*fp16" for n in ("Q", "K", "V", "Out", "Bias", "KScale", "VScale")}
    types.update(query_positions="*i64", scale="fp32")
    for name in ("query_start_loc", "seq_lens", "block_table", "work_req", "work_mblock"):
        types[name] = "*i32"
    fp8 = dict(types, K="*fp8e4nv", V="*fp8e4nv", KScale="*fp32", VScale="*fp32")
    base = dict(NUM_HEADS=8, NUM_KV_HEADS=2, HEAD_DIM=64, BLOCK_D=64, BLOCK_M=64, BLOCK_N=64,
                PAGE=16, REL_NB=16, REL_MAX_EXACT=8, REL_LOG_RATIO=2.77, BIDIRECTIONAL=True,
                DOT_PRECISION="tf32", FP8_KV=False)  # fmt: skip
    cases = []
    for paged, causal, bias in [(True, True, 0), (False, False, 0), (True, False, 1),
                                (True, True, 2), (False, False, 2)]:  # fmt: skip
        label = f"paged={paged} causal={causal} bias={bias}"
        cases.append((label, types, dict(base, PAGED=paged, CAUSAL=causal, BIAS_MODE=bias), 4))
    cases.append(("paged fp8 cache", fp8, dict(base, PAGED=True, CAUSAL=True, BIAS_MODE=0,
                                               FP8_KV=True), 4))  # fmt: skip
    return cases


def absorbed_cases() -> list[tuple[str, dict[str, str], dict[str, Any], int]]:
    types = {"Q": "*fp16", "States": "*fp16", "Scales": "*fp32", "Out": "*fp16"}
    for name in ("query_start_loc", "seq_lens", "block_table", "work_req", "work_mblock"):
        types[name] = "*i32"
    large = dict(NUM_HEADS=20, D_MODEL=1280, CHUNK=256, NUM_CHUNKS=5, ROWS_PER_HALF=8, SPAN=4,
                 QUERY_BLOCK=16, BLOCK_R=16, BLOCK_N=64, NUM_TILES=20, DOT_PRECISION="tf32",
                 LOOP_STAGES=2, FP8=False)  # fmt: skip
    bart = dict(large, NUM_HEADS=16, D_MODEL=1024, NUM_CHUNKS=4, NUM_TILES=16)
    fp32 = dict(types, Q="*fp32", States="*fp32", Out="*fp32")
    small = dict(large, NUM_HEADS=4, D_MODEL=64, CHUNK=32, NUM_CHUNKS=2, NUM_TILES=4,
                 BLOCK_N=16, DOT_PRECISION="ieee")  # fmt: skip
    return [
        ("large-v3, fp16 states", types, large, 8),
        ("BART width", types, bart, 8),
        ("large-v3, fp8 states", dict(types, States="*fp8e4nv"), dict(large, FP8=True), 8),
        ("fp32 model", fp32, small, 8),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default="HEAD", help="git revision to compare the working tree with")
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    differing = 0
    for path, kernel, cases in [
        (PAGED, "_attention_kernel", paged_cases()),
        (ABSORBED, "_absorbed_attention_kernel", absorbed_cases()),
    ]:
        old = getattr(module_at(args.base, path, "base_kernels"), kernel)
        new = getattr(module_at(None, path, "tree_kernels"), kernel)
        for label, types, constexprs, warps in cases:
            a = code_lines(compile_ptx(old, types, constexprs, warps))
            b = code_lines(compile_ptx(new, types, constexprs, warps))
            same = a == b
            differing += not same
            print(f"{kernel} ({label}): {'identical' if same else 'DIFFERENT'} PTX, {len(b)} lines")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
