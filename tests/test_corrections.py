"""The corrections of tidal/algorithms/corrections.py against values computed by hand: truncated, masked
and IcePop importance weights per token and per sequence, AIPO, dual clip, the log-ratio clamp, and
their bad configs."""
from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from tidal.algorithms.base import LossInputs
from tidal.algorithms.gspo import GSPOConfig
from tidal.algorithms.grpo import GRPOConfig
from tidal.algorithms.token_loss import token_level_loss

LN = math.log
MASK = torch.tensor([[True, True, True], [True, True, False]])
ADV = torch.tensor([1.0, -2.0])
# log pi_old - log mu per token: k = pi_old / mu is [1, 3, 0.5] and [4, 1] (the third is padding)
DELTA = torch.tensor([[0.0, LN(3), LN(0.5)], [LN(4), 0.0, 0.0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, float("nan")]])


def _loss(*, logp=None, old=OLD, behaviour=OLD - DELTA, **cfg):
    """A token-sum loss (tokens normaliser) on the first pass (pi = pi_old unless `logp` says otherwise)."""
    logp = (old.clone() if logp is None else logp).nan_to_num(0.0).requires_grad_(True)
    inputs = LossInputs(logp_NT=logp, old_logp_NT=old, ref_logp_NT=None, mask_NT=MASK, adv_N=ADV,
                        behaviour_logp_NT=behaviour)
    out = token_level_loss(inputs, GRPOConfig(**cfg), normaliser="tokens", per_sequence_mean=False)
    out.loss_sum.backward()
    return out, logp.grad


def test_no_correction_is_the_plain_surrogate():
    out, grad = _loss()
    assert out.loss_sum.item() == pytest.approx(-(1 * 3) + 2 * 2)  # -A per token at ratio 1
    assert out.stats["is_weight_mean"].value() == 1 and out.stats["is_dropped_frac"].total == 0
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -1.0, -1.0], [2.0, 2.0, 0.0]]))


def test_truncated_is_per_token_and_per_sequence():
    out, grad = _loss(correction={"kind": "tis"})  # cap 2: weights [1, 2, 0.5] and [2, 1]
    assert out.loss_sum.item() == pytest.approx(-(1 + 2 + 0.5) + 2 * (2 + 1))
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -2.0, -0.5], [4.0, 2.0, 0.0]]))
    assert out.stats["is_weight_mean"].total == pytest.approx(6.5) and out.denom == 5
    # per sequence: K = 1 * 3 * 0.5 = 1.5 and 4 * 1 = 4, capped at 2
    out, _ = _loss(correction={"kind": "tis", "level": "sequence"})
    assert out.loss_sum.item() == pytest.approx(-(3 * 1.5) + 2 * (2 * 2))
    out, _ = _loss(correction={"kind": "tis", "high": 5.0})  # a looser cap keeps the 3 and the 4
    assert out.loss_sum.item() == pytest.approx(-(1 + 3 + 0.5) + 2 * (4 + 1))


def test_masked_is_drops_tokens_and_sequences_outside_the_band():
    out, grad = _loss(correction={"kind": "mis", "low": 0.6, "high": 2.0})  # keeps k = 1 of each sequence
    assert out.loss_sum.item() == pytest.approx(-1 + 2)
    assert out.stats["is_dropped_frac"].total == 3 and out.denom == 2  # dropped tokens leave the token count too
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 0.0, 0.0], [0.0, 2.0, 0.0]]))
    # per sequence (band [0, 2]): K = 1.5 keeps sequence 0, weighted 1.5; K = 4 drops sequence 1
    out, grad = _loss(correction={"kind": "mis", "level": "sequence"})
    assert out.loss_sum.item() == pytest.approx(-(3 * 1.5))
    assert out.stats["is_dropped_frac"].total == 2 and out.denom == 3
    torch.testing.assert_close(grad, torch.tensor([[-1.5, -1.5, -1.5], [0.0, 0.0, 0.0]]))


def test_icepop_keeps_its_band_inclusive():
    out, _ = _loss(correction={"kind": "icepop"})  # [0.5, 5]: every ratio here is inside, 0.5 included
    assert out.loss_sum.item() == pytest.approx(-(1 + 3 + 0.5) + 2 * (4 + 1)) and out.stats["is_dropped_frac"].total == 0
    out, _ = _loss(correction={"kind": "icepop", "high": 3.5})  # the 4 is out
    assert out.loss_sum.item() == pytest.approx(-(1 + 3 + 0.5) + 2 * 1) and out.stats["is_dropped_frac"].total == 1


def test_aipo_weighs_the_policy_gradient_by_the_ratio_to_mu_clipped_at_rho():
    # pi / mu with pi = pi_old: [1, 3, 0.5] and [4, 1]; rho 2. No ratio to pi_old enters: a different
    # pi_old changes nothing, where the clipped surrogate would clip every token
    out, grad = _loss(correction={"kind": "aipo"}, old=OLD + 5.0, logp=OLD.clone())
    assert out.loss_sum.item() == pytest.approx(-(1 + 2 + 0.5) + 2 * (2 + 1))
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -2.0, -0.5], [4.0, 2.0, 0.0]]))
    # above rho the weight stays rho (a constant): the gradient does not vanish as a clipped ratio's would
    out, grad = _loss(correction={"kind": "aipo", "high": 10.0}, old=OLD + 5.0, logp=OLD.clone())
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -3.0, -0.5], [8.0, 2.0, 0.0]]))


def test_a_correction_of_ones_own_is_one_file_named_in_the_config():
    """tests/objective_plugin.py: geometric-mean sequence TIS. k = [1, 3, 0.5] has the geometric mean
    1.5 ** (1/3); [4, 1] has 2, at the cap."""
    plugin = {"kind": "tests.objective_plugin:GEO_TIS"}
    out, grad = _loss(correction=plugin)
    g = 1.5 ** (1 / 3)
    assert out.loss_sum.item() == pytest.approx(-(3 * g) + 2 * (2 * 2))
    torch.testing.assert_close(grad, torch.tensor([[-g, -g, -g], [4.0, 4.0, 0.0]]))
    assert out.stats["is_weight_mean"].total == pytest.approx(3 * g + 4)
    out, _ = _loss(correction={**plugin, "high": 1.1})
    assert out.loss_sum.item() == pytest.approx(-(3 * 1.1) + 2 * (2 * 1.1))
    with pytest.raises(ValidationError, match="correction.kind='tests.objective_plugin:GEO_TIS' has no lower bound"):
        GRPOConfig(correction={**plugin, "low": 0.5})
    with pytest.raises(ValidationError, match="module .tests.objective_plugin. has no attribute .NOPE."):
        GRPOConfig(correction={"kind": "tests.objective_plugin:NOPE"})
    with pytest.raises(ValidationError, match="tests.objective_plugin.geo_tis_weights is of type function, where an "
                                              "object of type Correction is needed"):
        GRPOConfig(correction={"kind": "tests.objective_plugin:geo_tis_weights"})


def test_dual_clip_caps_the_loss_of_negative_advantages():
    # token 0 of sequence 1 (A = -2) has ratio 5: the surrogate's loss is -(5 * -2) = 10, capped at 3 * 2
    logp = OLD.clone()
    logp[1, 0] += LN(5)
    out, grad = _loss(logp=logp, clip_ratio_c=3.0)
    assert out.loss_sum.item() == pytest.approx(-3 + 6 + 2)
    assert grad[1, 0] == 0 and out.stats["clip_low_frac"].total == 1  # the cap is a constant; counted as clipped
    plain, _ = _loss(logp=logp)
    assert plain.loss_sum.item() == pytest.approx(-3 + 10 + 2)


def test_log_ratio_clamp():
    logp = OLD.clone()
    logp[0, 0] += 3.0  # ratio e^3, clamped to e^1; clip_high 30 keeps the clip itself out of the way
    out, _ = _loss(logp=logp, log_ratio_clamp=1.0, clip_high=30.0)
    assert out.loss_sum.item() == pytest.approx(-(math.e + 2) + 4)
    out, _ = _loss(logp=logp, clip_high=30.0)
    assert out.loss_sum.item() == pytest.approx(-(math.e ** 3 + 2) + 4)


def test_bad_configs_are_named():
    cases = [({"correction": {"kind": "aipo", "level": "sequence"}}, "correction.kind='aipo' is per token"),
             ({"correction": {"kind": "tis", "low": 0.5}}, "correction.kind='tis' has no lower bound"),
             ({"correction": {"kind": "mis", "low": 2.0, "high": 1.0}}, r"correction.low \(2\) must be below"),
             ({"correction": {"kind": "nope"}}, "kind"),
             ({"clip_ratio_c": 1.0}, "clip_ratio_c"),
             ({"log_ratio_clamp": 0.0}, "log_ratio_clamp")]
    for cfg, message in cases:
        with pytest.raises(ValidationError, match=message):
            GRPOConfig(**cfg)
    with pytest.raises(ValidationError, match="correction: gspo.s ratio is per sequence"):
        GSPOConfig(correction={"kind": "tis"})
    with pytest.raises(ValueError, match="needs the generator's log-probs"):
        _loss(correction={"kind": "tis"}, behaviour=None)


# ---- end to end: the generator's log-probs reach the loss under every layout ------------------------

def test_corrections_end_to_end(tmp_path):
    """A correction, a surrogate and a penalty of one's own (tests/objective_plugin.py, a file of one's own: the
    path is every kind's) on one trainer rank and on two (dp=2; two epochs: the second reads mu again) train the
    same weights, the correction's weights ~1 on-policy, the penalty's figure reported (0 on a first pass only);
    a masked-IS band no token falls in trains nothing."""
    from tests.e2e import launch, max_abs_diff, metrics, weights

    tis = ["--set", "algorithm.correction.kind=tests.objective_plugin:GEO_TIS", "--set", "trainer.epochs=2",
           "--set", "algorithm.surrogate=tests.objective_plugin:UNCLIPPED",
           "--set", 'algorithm.penalties={"tests.objective_plugin:OLD_K2": 0.5}',
           "--set", "reward.functions=[tests.rewards:length_parity]"]  # dense: every pass has a signal
    for name, extra, nproc in (("one", [], 3), ("dp2", ["--set", "trainer.dp=2"], 4)):
        proc = launch(tmp_path / name, *tis, *extra, nproc=nproc, steps=2)
        assert proc.returncode == 0, proc.stderr[-3000:]
    one, dp2 = metrics(tmp_path / "one"), metrics(tmp_path / "dp2")
    assert [r["trainer/rollout_digest"] for r in one] == [r["trainer/rollout_digest"] for r in dp2]
    assert max_abs_diff(weights(tmp_path / "one/final"), weights(tmp_path / "dp2/final")) < 1e-5
    for r in one + dp2:  # fp32 engines agree to ~1e-6 in log-prob: weights within 1e-4 of 1, nothing dropped
        assert abs(r["trainer/is_weight_mean"] - 1) < 1e-4 and r["trainer/is_dropped_frac"] == 0 and r["trainer/optimizer_steps"] == 2
        assert r["trainer/old_k2"] > 0 and r["trainer/clip_frac"] == 0  # the second epoch moved pi; nothing clips
    assert [r["trainer/old_k2"] for r in one] == pytest.approx([r["trainer/old_k2"] for r in dp2], rel=1e-4)

    proc = launch(tmp_path / "none", "--set", "algorithm.correction.kind=mis", "--set", "algorithm.correction.low=3",
                  "--set", "algorithm.correction.high=4", steps=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in metrics(tmp_path / "none"):
        assert r["trainer/is_dropped_frac"] == 1 and r["trainer/loss"] == 0 and r["trainer/grad_norm"] == 0
