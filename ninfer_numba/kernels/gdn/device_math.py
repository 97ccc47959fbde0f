"""Device helpers shared by the GDN kernels: activations and gates (reductions: kernels/reduce.py).

All arithmetic is float32 (math.exp/log on float32 arguments lower to the accurate libdevice calls;
fastmath stays off so the kernels track the float64 reference to fp32 rounding).
"""
import math

from numba import float32

from ninfer_numba.kernels.numba_env import cuda


@cuda.jit(device=True)
def sigmoid_f32(x):
    # e^{-|x|} never overflows; one exp and one reciprocal for either sign, no branch (a branch by sign made
    # the conv's warps run both sides, with an IEEE division on one: ~30 instructions a value). x < 0 gives
    # e · 1/(1 + e), within an ulp of e / (1 + e)
    e = float32(math.exp(-abs(x)))
    r = float32(1.0) / (float32(1.0) + e)
    return r if x >= float32(0.0) else e * r


@cuda.jit(device=True)
def silu_f32(x):
    return x * sigmoid_f32(x)


@cuda.jit(device=True)
def gate_log_decay(alpha_raw, a, dt_bias):
    """g = a * softplus(alpha_raw + dt_bias), with ggml's identity above 20."""
    x = float32(alpha_raw) + float32(dt_bias)
    if x <= float32(20.0):
        x = float32(math.log1p(math.exp(x)))
    return float32(a) * x


@cuda.jit(device=True, inline=True)
def gated_rms_inverse(ss, n, eps):
    """1 / sqrt(ss / n + eps): the inverse RMS of a GDN output head whose n squares sum to ss."""
    return float32(1.0) / float32(math.sqrt(ss / float32(n) + float32(eps)))


@cuda.jit(device=True, inline=True)
def gated_rms_apply(o, inv_rms, w, z):
    """One element of the GDN output's gated RMSNorm, o * inv_rms * w * silu(z), in this order: prefill's
    gated_norm and the kernels that fuse it into the next matmul's activation agree bit for bit."""
    return o * inv_rms * w * silu_f32(z)
