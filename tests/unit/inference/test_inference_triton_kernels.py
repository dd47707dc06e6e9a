"""The Triton kernels of the torch engine's fused decode step (triton_kernels.py) against the torch path.

On CPU they run in Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the variable is read when the
kernels are defined) where Triton is installed; CI's CPU venv has no Triton and skips that test. On a GPU
the `gpu` tests run them compiled: the self-check the engine runs at load, in float32 and bfloat16 at the
Qwen3-0.6B head shapes, and whole generations (greedy tokens equal to the torch step's)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from gyre_inference.backend import SamplingParams
from gyre_inference.torch_backend import TorchBackend

HAS_TRITON = importlib.util.find_spec("triton") is not None

INTERPRETED = """
import sys
import numpy as np
from triton.runtime import interpreter

# Triton's interpreter calls int() on 1-element arrays, which numpy 2 refuses (the compiled kernels never do).
patch = interpreter._patch_lang_tensor
def patched(tensor, *args, **kwargs):  # its signature differs between Triton versions
    patch(tensor, *args, **kwargs)
    tensor.__index__ = lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])
interpreter._patch_lang_tensor = patched

import asyncio, torch
from types import SimpleNamespace
from gyre_inference.backend import SamplingParams
from gyre_inference.model_runner import TorchOps
from gyre_inference.torch_backend import TorchBackend
from gyre_inference.triton_kernels import TritonOps, self_check

# float16, not bfloat16: the interpreter stores bfloat16 as raw integers and cannot multiply them
for dtype in (torch.float32, torch.float16):
    for heads, kv_heads, dim in ((16, 8, 128), (4, 4, 32)):
        runner = SimpleNamespace(device=torch.device("cpu"), dtype=dtype, heads=heads, kv_heads=kv_heads,
                                 head_dim=dim, block_size=16, hidden_size=64)
        self_check(TritonOps(), TorchOps(), runner)

async def tokens(attention):
    engine = TorchBackend(sys.argv[1], threads=1, max_batch_size=4, attention=attention)
    await engine.start()
    try:
        prompts = [list(range(5, 45)), [5, 6, 7]]
        runs = [[e async for e in engine.generate(p, SamplingParams(max_tokens=20, seed=i))]
                for i, p in enumerate(prompts)]
        return [[(e.token_id, round(e.logprob, 4)) for e in run] for run in runs]
    finally:
        await engine.shutdown()

assert asyncio.run(tokens("triton")) == asyncio.run(tokens("torch"))
print("interpreted kernels match")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (CPU venv)")
def test_the_kernels_match_the_torch_path_in_triton_s_interpreter(tiny_model, tmp_path):
    script = tmp_path / "interpreted.py"
    script.write_text(textwrap.dedent(INTERPRETED))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(script), str(tiny_model)], capture_output=True, text=True, env=env,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "interpreted kernels match" in done.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(16, 8, 128), (4, 4, 32), (4, 2, 16)])
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_kernels_pass_their_self_check_on_the_gpu(dtype, heads, kv_heads, dim):
    from types import SimpleNamespace

    from gyre_inference.model_runner import TorchOps
    from gyre_inference.triton_kernels import TritonOps, self_check

    runner = SimpleNamespace(device=torch.device("cuda"), dtype=dtype, heads=heads, kv_heads=kv_heads, head_dim=dim,
                             block_size=16, hidden_size=1024)  # fmt: skip
    self_check(TritonOps(), TorchOps(), runner)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.asyncio
async def test_the_fused_triton_step_gives_the_tokens_of_the_torch_step_on_the_gpu(tiny_model, dtype):
    """The engine installs the Triton kernels on CUDA (its load-time self-check passes) and, with CUDA
    graphs, generates what the torch step generates (greedy; in bfloat16 the two steps round differently, so
    a near tie may flip a later token: there the first decode step's tokens must agree)."""

    async def run(attention):
        engine = TorchBackend(tiny_model, device="cuda", dtype=dtype, max_batch_size=8, attention=attention)
        await engine.start()
        try:
            prompts = [list(range(5, 45)), [5, 6, 7], list(range(100, 300))]
            results = await asyncio.gather(*(_tokens(engine, p) for p in prompts))
            return results, engine._runner.ops
        finally:
            await engine.shutdown()

    (fused, ops), (plain, none) = await run("auto"), await run("torch")
    assert ops is not None and ops.name == "triton" and none is None
    if dtype == "float32":
        assert fused == plain
    else:
        assert [r[:2] for r in fused] == [r[:2] for r in plain]


async def _tokens(engine, prompt):
    return [e.token_id async for e in engine.generate(prompt, SamplingParams(max_tokens=64, temperature=0.0))]


def _compile_for_hopper(kernel, signature: dict, constants: dict):
    """Compile `kernel` down to PTX for an H100/H200 (sm_90) without a GPU: Triton's front end and ptxas run on
    any machine, and this is where a kernel that the interpreter runs happily can still be refused (the
    interpreter executes Python; the compiler types every value)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(
        fn=kernel, signature={**signature, **dict.fromkeys(constants, "constexpr")}, constexprs=constants
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (CPU venv)")
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_every_kernel_compiles_for_hopper(dtype):
    """Each kernel, at the Qwen3-0.6B shape the GPU checks serve (16 heads, 8 KV heads, head dim 128, hidden 1024),
    compiles to PTX. A runtime `if` that bound one name to a pointer in one branch and an int in the other ran in
    the interpreter and failed here, and on the GPU the self-check then fell back to the slow torch path."""
    import gyre_inference.triton_kernels as kernels

    p = "*" + dtype
    decode = dict(Q=p, K=p, V=p, OUT=p, TABLE="*i32", CONTEXT="*i64", scale="fp32", q_row="i32", q_head="i32",
                  o_row="i32", o_head="i32", k_block="i32", k_token="i32", k_head="i32", table_row="i32")  # fmt: skip
    norm = dict(X=p, R=p, W=p, OUT=p, R_OUT=p, eps="fp32")
    rope = dict(Q=p, K=p, V=p, COS=p, SIN=p, QW=p, KW=p, Q_OUT=p, K_CACHE=p, V_CACHE=p, SLOTS="*i64", eps="fp32",
                q_row="i32", k_row="i32", v_row="i32", cos_row="i32")  # fmt: skip
    builds = [
        (kernels._paged_decode, decode, dict(GROUP=2, GP=16, D=128, BD=128, PAGE=16, BN=64, IEEE=dtype == "fp32")),
        (kernels._add_rms_norm, norm, dict(H=1024, BH=1024, HAS_X=True)),
        (kernels._add_rms_norm, norm, dict(H=1024, BH=1024, HAS_X=False)),
        (kernels._rope_and_write, rope, dict(HEADS=16, KV_HEADS=8, HALF=64, NORM=True)),
        (kernels._rope_and_write, rope, dict(HEADS=16, KV_HEADS=8, HALF=64, NORM=False)),
        (kernels._silu_mul, dict(GATE=p, UP=p, OUT=p, n="i32"), dict(BLOCK=1024)),
    ]
    for kernel, signature, constants in builds:
        assert "ptx" in _compile_for_hopper(kernel, signature, constants).asm, kernel.__name__
