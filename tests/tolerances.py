"""Tolerances argued from the arithmetic, for comparing two computations of the same math in another order
(packed against separate rows, one micro-batch against several, a shared prompt's gradient summed over its G
responses in another place).

Such comparisons run in float64 (the model's parameters and activations), whose unit roundoff 2^-53 = 1.1e-16
makes the gap a property of the arithmetic rather than of a machine's kernels: those order their float32 sums
by the call's shape, and a tolerance fitted to one machine's float32 failed on another's (tests/test_numerics.py).

EQUAL, log-probs: a log-prob (|x| < 10) passes about 10 reductions per layer of at most ~600 terms (hidden 128,
intermediate 384, vocabulary 512) of |x| < 10; two orders part by at most ~2 * 10 * 600 * 2^-53 * 10 = 1.3e-11 a
layer, ~1e-10 over the embedded model's 4 layers and head. 1e-9 leaves a margin of 10, and a real fault moves a
log-prob by > 1e-2 (tests/test_packing.py::test_a_wrong_mask_changes_the_result).

close_grads: transformers computes a model's RMSNorm in float32 even for a float64 model (it casts), so where
the two computations reach a norm with another float64 value (a shared prompt's gradient is the sum of its G
responses' before the norm's backward, not after) the norm rounds at float32: once at the cast, and over the 128
entries its backward reduces. Over the 9 norms on a token's path that is at most 9 * 129 * 2^-24 = 7e-5 of the
entries' scale, ~sqrt(9 * 129) * 2^-24 = 2e-6 typically (measured: 9e-8). GRAD_REL = 1e-5 of each gradient
tensor's largest entry: 100x the measured gap, still 10^3 below a gradient that misses one response.

LOGP_OF_FLOAT64, a float32 log-prob the engine samples from a float64 model's logits (the engine's sampler works in
float32 by design), against the same from another batch or a teacher-forced forward: the float64 logits agree to
~1e-14 (EQUAL's argument), so their float32 casts are equal unless one lies that close to a rounding boundary,
where they part by one ulp: 2^-21 = 4.8e-7 for |logit| < 8 (the random model's are < 1.3, < 6.3 with the tests'
EOS bias; a critic's float32 values of a float64 model likewise). A log-softmax row then moves by at most that ulp plus its share of the log-sum-exp (< 1): 1e-6;
2e-6 leaves a margin of 2 and holds on a machine whose float32 kernels order their sums another way."""
import torch

EQUAL = dict(atol=1e-9, rtol=0)
LOGP_OF_FLOAT64 = dict(atol=2e-6, rtol=0)
GRAD_REL = 1e-5


def close_grads(got: list[torch.Tensor], ref: list[torch.Tensor]) -> bool:
    return all(torch.allclose(a, b, atol=GRAD_REL * float(b.abs().max()), rtol=0) for a, b in zip(got, ref))
